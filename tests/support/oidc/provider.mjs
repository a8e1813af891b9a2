// The OpenID Connect provider the tests sign in with: panva's oidc-provider (OpenID Certified),
// configured as a company's identity provider would be for llmgw, and run by
// tests/support/oidc_provider.py.
//
//   OIDC_CONTROL_TOKEN=... node provider.mjs --port PORT --install FOLDER
//
// FOLDER is where `scripts/system-deps oidc` installed package.json's dependencies: an ES module
// resolves its imports from its own folder (NODE_PATH does not apply), so the package is found
// through FOLDER explicitly. It listens on 127.0.0.1:PORT, with the issuer http://127.0.0.1:PORT,
// prints `READY <issuer>` once it does, and stops on SIGTERM. Everything (users, clients, tokens,
// sessions) is kept in memory and gone when it stops.
//
// Besides the provider's own endpoints it serves:
// - /interaction/UID: the sign-in page (a username, any password); consent is given at once.
// - /__test__/...: the tests' control API, JSON, answering only requests that carry
//   `Authorization: Bearer <OIDC_CONTROL_TOKEN>`:
//     PUT    /__test__/users/SUB       {email, name, preferred_username, groups, disabled}
//     DELETE /__test__/users/SUB
//     PUT    /__test__/clients/ID      client metadata as in dynamic registration (RFC 7591)
//     DELETE /__test__/clients/ID
//     GET    /__test__/signing-key     the private signing JWK
//     POST   /__test__/sign-out        {sub}: ends the user's sessions here, as a sign-out on
//                                      the provider's side does, with back-channel logout

import { generateKeyPairSync, randomBytes, timingSafeEqual } from 'node:crypto';
import { createServer } from 'node:http';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { parseArgs } from 'node:util';

const { values: options } = parseArgs({
  options: { port: { type: 'string' }, install: { type: 'string' } },
});
const controlToken = process.env.OIDC_CONTROL_TOKEN ?? '';
if (!options.port || !options.install || controlToken.length < 16) {
  console.error(
    'usage: OIDC_CONTROL_TOKEN=<16 or more characters> node provider.mjs --port PORT --install FOLDER',
  );
  process.exit(2);
}

const packageMain = createRequire(join(options.install, 'package.json')).resolve('oidc-provider');
const { default: Provider } = await import(pathToFileURL(packageMain).href);
// The package's own in-memory adapter, given a store without its size limit: its default store
// forgets the oldest of 1,000 entries, and a whole test session's clients, grants and sessions
// can be more than that.
const { default: MemoryAdapter } = await import(
  pathToFileURL(join(dirname(packageMain), 'adapters', 'memory_adapter.js')).href
);

const issuer = `http://127.0.0.1:${options.port}`;

/** The adapter's store: entries kept until their time is up, and none forgotten before. */
class Store {
  #entries = new Map();

  get(key) {
    const entry = this.#entries.get(key);
    if (entry === undefined) return undefined;
    if (entry.expiresAt <= Date.now()) {
      this.#entries.delete(key);
      return undefined;
    }
    return entry.value;
  }

  set(key, value, { maxAge } = {}) {
    const expiresAt = maxAge === undefined ? Infinity : Date.now() + maxAge;
    this.#entries.set(key, { value, expiresAt });
  }

  delete(key) {
    this.#entries.delete(key);
  }

  /** The ids of the live entries of one model (`Session`, `Client`, ...). */
  idsOf(model) {
    const prefix = `${model}:`;
    return [...this.#entries.keys()]
      .filter((key) => key.startsWith(prefix) && this.get(key) !== undefined)
      .map((key) => key.slice(prefix.length));
  }
}

const store = new Store();
const adapterFor = (model) => new MemoryAdapter(model, store);

/** The people who can sign in, by subject. A disabled or removed one cannot, and the tokens
 * issued to them stop working: oidc-provider refuses a grant whose account is not found. */
const users = new Map();

function userClaims(user) {
  return {
    sub: user.sub,
    email: user.email,
    email_verified: true,
    name: user.name,
    preferred_username: user.preferred_username,
    groups: user.groups,
  };
}

/** The user a sign-in form names: by preferred_username, else by subject. */
function userByLogin(login) {
  return [...users.values()].find((user) => user.preferred_username === login) ?? users.get(login);
}

const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
const signingKey = {
  ...privateKey.export({ format: 'jwk' }),
  kid: randomBytes(8).toString('hex'),
  alg: 'RS256',
  use: 'sig',
};

// -- the pages ----------------------------------------------------------------------------------

function escapeHtml(value) {
  return String(value).replace(
    /[&<>"']/g,
    (char) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' })[char],
  );
}

/** A whole page around `body` (HTML already escaped), loading nothing from elsewhere. */
function page(title, body) {
  return `<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>${escapeHtml(title)}</title></head>
<body>
${body}
</body>
</html>`;
}

// oidc-provider's own pages for the device flow, logout and errors, with their forms, buttons and
// headings as they are, without the web font their style sheets load from fonts.googleapis.com:
// nothing a test's browser shows may reach outside the machine.
const pages = {
  async userCodeInputSource(ctx, form, out, err) {
    let message = 'Enter the code displayed on your device';
    if (err && (err.userCode || err.name === 'NoCodeError')) {
      message = 'The code you entered is incorrect. Try again';
    } else if (err && err.name === 'AbortedError') {
      message = 'The Sign-in request was interrupted';
    } else if (err) {
      message = 'There was an error processing your request';
    }
    ctx.body = page('Sign-in', `<h1>Sign-in</h1>
<p${err ? ' role="alert"' : ''}>${message}</p>
${form}
<button type="submit" form="op.deviceInputForm">Continue</button>`);
  },
  async userCodeConfirmSource(ctx, form, client, deviceInfo, userCode) {
    ctx.body = page('Device Login Confirmation', `<h1>Confirm Device</h1>
<p><strong>${escapeHtml(client.clientName ?? client.clientId)}</strong></p>
<p>The following code should be displayed on your device: <code>${escapeHtml(userCode)}</code></p>
${form}
<button autofocus type="submit" form="op.deviceConfirmForm">Continue</button>
<button type="submit" form="op.deviceConfirmForm" value="yes" name="abort">[ Abort ]</button>`);
  },
  async successSource(ctx) {
    ctx.body = page('Sign-in Success', `<h1>Sign-in Success</h1>
<p>Your sign-in was successful, you can now close this page.</p>`);
  },
  async logoutSource(ctx, form) {
    ctx.body = page('Logout Request', `<h1>Do you want to sign-out from ${escapeHtml(ctx.host)}?</h1>
${form}
<button autofocus type="submit" form="op.logoutForm" value="yes" name="logout">Yes, sign me out</button>
<button type="submit" form="op.logoutForm">No, stay signed in</button>`);
  },
  async postLogoutSuccessSource(ctx) {
    ctx.body = page('Sign-out Success', '<h1>Sign-out Success</h1>\n<p>Your sign-out was successful.</p>');
  },
  async renderError(ctx, out) {
    ctx.type = 'html';
    ctx.body = page('oops! something went wrong', `<h1>oops! something went wrong</h1>
${Object.entries(out).map(([key, value]) => `<pre><strong>${escapeHtml(key)}</strong>: ${escapeHtml(value)}</pre>`).join('\n')}`);
  },
};

const provider = new Provider(issuer, {
  adapter: adapterFor,
  jwks: { keys: [signingKey] },
  cookies: { keys: [randomBytes(32).toString('base64url')] },
  async findAccount(ctx, sub) {
    const user = users.get(sub);
    if (user === undefined || user.disabled) return undefined;
    return {
      accountId: sub,
      // Read when the claims are asked for: a user changed since sign-in gets the new ones.
      async claims() {
        return userClaims(users.get(sub) ?? user);
      },
    };
  },
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name', 'preferred_username'],
    groups: ['groups'],
  },
  // The scopes' claims in the ID token itself, not only from userinfo: a relying party may read
  // the user from the ID token alone.
  conformIdTokenClaims: false,
  // A refresh token to every client registered for the refresh_token grant, as company
  // providers do; oidc-provider's default also wants offline_access, which OIDC Core grants
  // only with prompt=consent. Without offline_access the refresh token ends with the user's
  // session here (sign-out); with it, it outlives the session.
  async issueRefreshToken(ctx, client) {
    return client.grantTypeAllowed('refresh_token');
  },
  // Without oidc-provider's dispatcher, which refuses loopback and private addresses (its
  // protection against SSRF): the relying parties here, and their back-channel logout URIs, are
  // all on 127.0.0.1.
  fetch(url, { dispatcher, ...options }) {
    return globalThis.fetch(url, options);
  },
  // In seconds: oidc-provider's defaults, written out.
  ttl: {
    AccessToken: 3600,
    AuthorizationCode: 60,
    DeviceCode: 600,
    Grant: 14 * 24 * 3600,
    IdToken: 3600,
    Interaction: 3600,
    RefreshToken: 14 * 24 * 3600,
    Session: 14 * 24 * 3600,
  },
  interactions: {
    url(ctx, interaction) {
      return `/interaction/${interaction.uid}`;
    },
  },
  features: {
    devInteractions: { enabled: false },
    deviceFlow: {
      enabled: true,
      userCodeInputSource: pages.userCodeInputSource,
      userCodeConfirmSource: pages.userCodeConfirmSource,
      successSource: pages.successSource,
    },
    backchannelLogout: { enabled: true },
    rpInitiatedLogout: {
      enabled: true,
      logoutSource: pages.logoutSource,
      postLogoutSuccessSource: pages.postLogoutSuccessSource,
    },
    revocation: { enabled: true },
  },
  renderError: pages.renderError,
});

// -- the sign-in page ---------------------------------------------------------------------------

function signInPage(uid, clientName, { login = '', problem = '' } = {}) {
  return page('Sign in', `<h1>Sign in to ${escapeHtml(clientName)}</h1>
${problem ? `<p role="alert">${escapeHtml(problem)}</p>` : ''}
<form method="post" action="/interaction/${escapeHtml(uid)}" autocomplete="off">
  <label>Username <input name="login" value="${escapeHtml(login)}" autofocus required></label>
  <label>Password <input name="password" type="password"></label>
  <button type="submit">Sign in</button>
</form>
<a id="cancel" href="/interaction/${escapeHtml(uid)}/abort">Cancel</a>`);
}

function problemPage(problem) {
  return page('Sign in', `<p role="alert">${escapeHtml(problem)}</p>`);
}

async function readBody(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return Buffer.concat(chunks).toString('utf8');
}

function answerHtml(res, status, html) {
  res.writeHead(status, { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-store' });
  res.end(html);
}

// Consent is given at once, for what the request asks: these are the company's own
// applications. The grant is made as oidc-provider's example consent page makes it.
async function giveConsent(req, res, details) {
  const { prompt, params, session, grantId } = details;
  const grant = grantId
    ? await provider.Grant.find(grantId)
    : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
  if (prompt.details.missingOIDCScope) grant.addOIDCScope(prompt.details.missingOIDCScope.join(' '));
  if (prompt.details.missingOIDCClaims) grant.addOIDCClaims(prompt.details.missingOIDCClaims);
  for (const [indicator, scopes] of Object.entries(prompt.details.missingResourceScopes ?? {})) {
    grant.addResourceScope(indicator, scopes.join(' '));
  }
  const saved = await grant.save();
  const consent = grantId ? {} : { grantId: saved };
  await provider.interactionFinished(req, res, { consent }, { mergeWithLastSubmission: true });
}

async function interaction(req, res, uid, action) {
  let details;
  try {
    details = await provider.interactionDetails(req, res);
  } catch (error) {
    const problem = `This sign-in has ended or was never started here (${error.message}): start it again.`;
    answerHtml(res, 400, problemPage(problem));
    return;
  }
  if (details.uid !== uid) {
    answerHtml(res, 400, problemPage('This sign-in page belongs to another sign-in: start it again.'));
    return;
  }
  const client = await provider.Client.find(details.params.client_id);
  const clientName = client?.clientName ?? details.params.client_id;

  if (action === 'abort') {
    await provider.interactionFinished(req, res, {
      error: 'access_denied',
      error_description: 'The user cancelled the sign-in.',
    }, { mergeWithLastSubmission: false });
    return;
  }
  if (details.prompt.name === 'consent') {
    await giveConsent(req, res, details);
    return;
  }
  if (req.method === 'GET') {
    answerHtml(res, 200, signInPage(uid, clientName));
    return;
  }
  const form = new URLSearchParams(await readBody(req));
  const login = (form.get('login') ?? '').trim();
  const user = userByLogin(login);
  if (user === undefined || user.disabled) {
    const problem = user === undefined
      ? `No user is called "${login}".`
      : `The user "${login}" is disabled.`;
    answerHtml(res, 200, signInPage(uid, clientName, { login, problem }));
    return;
  }
  await provider.interactionFinished(
    req,
    res,
    { login: { accountId: user.sub } },
    { mergeWithLastSubmission: false },
  );
}

// -- the control API ----------------------------------------------------------------------------

class Refusal extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function authorized(req) {
  const given = Buffer.from(req.headers.authorization ?? '');
  const expected = Buffer.from(`Bearer ${controlToken}`);
  return given.length === expected.length && timingSafeEqual(given, expected);
}

async function readJson(req) {
  const text = await readBody(req);
  try {
    return text ? JSON.parse(text) : {};
  } catch {
    throw new Refusal(400, 'The body is not JSON.');
  }
}

function cleanUser(sub, body) {
  const strings = ['email', 'name', 'preferred_username'];
  for (const field of strings) {
    if (body[field] !== undefined && typeof body[field] !== 'string') {
      throw new Refusal(400, `${field} must be a string.`);
    }
  }
  const groups = body.groups ?? [];
  if (!Array.isArray(groups) || groups.some((group) => typeof group !== 'string')) {
    throw new Refusal(400, 'groups must be a list of strings.');
  }
  if (body.disabled !== undefined && typeof body.disabled !== 'boolean') {
    throw new Refusal(400, 'disabled must be true or false.');
  }
  return {
    sub,
    email: body.email ?? `${sub}@example.com`,
    name: body.name ?? sub,
    preferred_username: body.preferred_username ?? sub,
    groups,
    disabled: body.disabled ?? false,
  };
}

// Ends the user's sessions as RP-initiated logout with "sign me out of everything" does
// (oidc-provider's end_session): a logout token to each client of the session that has a
// back-channel logout URI, the grants revoked unless they were given offline_access, the
// session destroyed. Answers what was sent where.
async function signOut(sub) {
  const deliveries = [];
  for (const id of store.idsOf('Session')) {
    const session = await provider.Session.find(id);
    if (session === undefined || session.accountId !== sub) continue;
    for (const [clientId, authorization] of Object.entries(session.authorizations ?? {})) {
      const client = await provider.Client.find(clientId).catch(() => undefined);
      if (client?.backchannelLogoutUri) {
        const sid = session.sidFor(clientId);
        const delivery = { client_id: clientId, sid, delivered: true, error: null };
        try {
          await client.backchannelLogout(sub, sid);
        } catch (error) {
          Object.assign(delivery, { delivered: false, error: error.message });
        }
        deliveries.push(delivery);
      }
      if (authorization.grantId && !authorization.persistsLogout) {
        await Promise.all([
          provider.AccessToken.revokeByGrantId(authorization.grantId),
          provider.RefreshToken.revokeByGrantId(authorization.grantId),
          provider.AuthorizationCode.revokeByGrantId(authorization.grantId),
          provider.DeviceCode.revokeByGrantId(authorization.grantId),
          provider.Grant.adapter.destroy(authorization.grantId),
        ]);
      }
    }
    await session.destroy();
  }
  return deliveries;
}

async function control(req, res, path) {
  if (!authorized(req)) throw new Refusal(401, 'The control API needs the control token.');
  const [collection, id] = path.split('/').map(decodeURIComponent);
  const route = `${req.method} ${collection}${id === undefined ? '' : '/ID'}`;
  switch (route) {
    case 'PUT users/ID': {
      if (!id) throw new Refusal(400, 'A user needs a subject.');
      const user = cleanUser(id, await readJson(req));
      users.set(id, user);
      return [200, user];
    }
    case 'DELETE users/ID':
      if (!users.delete(id)) throw new Refusal(404, `No user has the subject "${id}".`);
      return [204, null];
    case 'PUT clients/ID': {
      const metadata = { ...(await readJson(req)), client_id: id };
      try {
        await provider.Client.validate(metadata);
      } catch (error) {
        throw new Refusal(400, `The client is refused: ${error.error_description ?? error.message}`);
      }
      await adapterFor('Client').upsert(id, metadata);
      return [200, (await provider.Client.find(id)).metadata()];
    }
    case 'DELETE clients/ID':
      if (!(await adapterFor('Client').find(id))) {
        throw new Refusal(404, `No client has the id "${id}".`);
      }
      await adapterFor('Client').destroy(id);
      return [204, null];
    case 'GET signing-key':
      return [200, signingKey];
    case 'POST sign-out': {
      const { sub } = await readJson(req);
      if (typeof sub !== 'string' || !sub) throw new Refusal(400, 'sign-out needs a sub.');
      return [200, { deliveries: await signOut(sub) }];
    }
    default:
      throw new Refusal(404, `The control API has no ${req.method} /__test__/${path}.`);
  }
}

async function answerControl(req, res, path) {
  let status;
  let body;
  try {
    [status, body] = await control(req, res, path);
  } catch (error) {
    if (!(error instanceof Refusal)) throw error;
    [status, body] = [error.status, { error: error.message }];
  }
  res.writeHead(status, body === null ? {} : { 'content-type': 'application/json' });
  res.end(body === null ? undefined : JSON.stringify(body));
}

// -- the server ---------------------------------------------------------------------------------

const providerCallback = provider.callback();

const server = createServer(async (req, res) => {
  const { pathname } = new URL(req.url, issuer);
  try {
    if (pathname.startsWith('/__test__/')) {
      await answerControl(req, res, pathname.slice('/__test__/'.length));
      return;
    }
    const page = pathname.match(/^\/interaction\/([^/]+)(\/abort)?$/);
    if (page && (req.method === 'GET' || (req.method === 'POST' && !page[2]))) {
      await interaction(req, res, page[1], page[2] ? 'abort' : 'sign-in');
      return;
    }
    providerCallback(req, res);
  } catch (error) {
    console.error(error);
    if (!res.headersSent) {
      res.writeHead(500, { 'content-type': 'text/plain; charset=utf-8' });
    }
    res.end(`internal error: ${error.message}`);
  }
});

server.listen(Number(options.port), '127.0.0.1', () => {
  console.log(`READY ${issuer}`);
});

process.on('SIGTERM', () => {
  server.close();
  server.closeAllConnections();
  process.exit(0);
});
