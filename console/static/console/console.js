// When htmx gets an answer it does not swap (a server error, a lost connection), say so
// instead of leaving the button looking as though nothing happened.
document.addEventListener("htmx:responseError", (event) => {
  const xhr = event.detail.xhr;
  const status = xhr ? xhr.status : "?";
  // A write refused for want of disk space (507) says so in a sentence of its own.
  const type = xhr ? xhr.getResponseHeader("content-type") || "" : "";
  if (status === 507 && type.startsWith("text/plain") && xhr.responseText) {
    flash(xhr.responseText);
    return;
  }
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

// The registry part of a model (or its row in the models list) is replaced every two seconds
// while a rollout runs. A confirmation someone opened in it (Roll back…) stays open across
// those refreshes, rather than closing under their pointer.
const openConfirmations = new Set();
document.addEventListener("htmx:beforeSwap", (event) => {
  const target = event.detail.target;
  if (!target || !target.querySelectorAll) return;
  target.querySelectorAll(".registry details[id][open]").forEach((details) => {
    openConfirmations.add(details.id);
  });
});
document.addEventListener("htmx:afterSettle", () => {
  for (const id of openConfirmations) {
    const details = document.getElementById(id);
    if (details) details.open = true;
  }
  openConfirmations.clear();
});
