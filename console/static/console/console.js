// When htmx gets an answer it does not swap (a server error, a lost connection), say so
// instead of leaving the button looking as though nothing happened.
document.addEventListener("htmx:responseError", (event) => {
  const status = event.detail.xhr ? event.detail.xhr.status : "?";
  flash(`The server could not do that (status ${status}). Reload the page and try again.`);
});
document.addEventListener("htmx:sendError", () => {
  flash("The control plane did not answer. Check the connection, then try again.");
});

function flash(text) {
  const box = document.getElementById("flash");
  if (!box) return;
  const note = document.createElement("p");
  note.className = "notice error";
  note.setAttribute("role", "alert");
  note.textContent = text;
  box.replaceChildren(note);
}
