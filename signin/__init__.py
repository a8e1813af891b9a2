"""Sign in with your company: llmgw as an OpenID Connect relying party (authorization code
flow with PKCE and a nonce), for the console and the admin. docs/signin.md says how to set it up.

Built on `requests` (through core.outbound's guarded session) and `joserfc` for the JOSE parts,
rather than on a sign-in library, because each of those would have had to be worked around
where it matters most here:
- mozilla-django-oidc matches users by e-mail out of the box (an account takeover when a
  provider lets people set their address), reads no discovery document (every endpoint is a
  setting of its own), fetches the JWKS at every sign-in without a cache, and follows
  redirects without a bound on the answer's size.
- django-allauth brings its own account system (sign-up, e-mail addresses, its own login and
  logout pages and tables) to replace the one the console, the admin and the API tokens share;
  far more than one provider's sign-in needs, and more pages to keep safe.
- Authlib's Django client is the closest fit (discovery, PKCE, nonce), but it makes its own
  HTTP requests: keeping them to the issuer's host, never following a redirect and bounding
  the answer's size would mean replacing its session, and its key cache and algorithm choice
  would need overriding to refuse what the provider does not advertise.
The flow itself is two requests and one token check (signin.oidc): small enough to own, and
owning it lets every request go through the same outbound rules as the rest of the control
plane, users be matched by issuer and subject alone, and every refusal be a Refused with the
project's words, audited (signin.audit).

Layering: signin sits above the other apps (it may import core, accounts, catalog, access);
nothing below imports it.
"""
