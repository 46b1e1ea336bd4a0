// Hangar's dashboard. No inline script (CSP). The API key lives in sessionStorage and
// travels only in the X-API-Key header: on every API call and on the event stream (read
// with fetch, since EventSource cannot send headers). WebSockets (terminal, desktop) are
// opened with single-use tickets.
import { showPorts } from "./ports.js";
import { createSecret, createVolume, refreshSecrets, refreshVolumes, showNetwork }
  from "./storage.js";

const KEY = "hangar.apiKey";
const $ = (sel) => document.querySelector(sel);
const enc = encodeURIComponent;
let rfb = null;
let terminal = null;   // { term, ws, sandbox, session, received, closed, decoder }
let detailId = null;
let eventsAbort = null;
const tasks = new Map();

function apiKey() { return sessionStorage.getItem(KEY) || ""; }
function headers(extra) { return { "X-API-Key": apiKey(), ...(extra || {}) }; }

async function api(method, path, body, extra) {
  const h = headers(extra);
  if (body !== undefined) h["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers: h, cache: "no-store",
                                body: body === undefined ? undefined : JSON.stringify(body) });
  const data = r.status === 204 ? {} : await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((data.error && data.error.message) || `HTTP ${r.status}`);
  return data;
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function button(parent, label, action, onClick, title) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.dataset.action = action;
  if (title) b.title = title;
  b.addEventListener("click", onClick);
  parent.append(b);
  return b;
}

function age(unix) {
  const s = Math.max(0, Date.now() / 1000 - unix);
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d`;
}

function bytes(n) {
  if (n < 1 << 20) return `${(n / 1024).toFixed(0)} KiB`;
  if (n < 1 << 30) return `${(n / (1 << 20)).toFixed(0)} MiB`;
  return `${(n / (1 << 30)).toFixed(1)} GiB`;
}

function status(sel, state, text) {
  const s = $(sel);
  s.dataset.state = state;
  s.textContent = text;
  s.classList.toggle("error", state === "error");
}

// -- lists ------------------------------------------------------------------------------------

async function refresh() {
  if (!apiKey()) { status("#list-status", "idle", "Enter the API key to see the server."); return; }
  await Promise.all([refreshSandboxes(), refreshMachines(), refreshSnapshots(), refreshPool(),
                     refreshVolumes(api, act), refreshSecrets(api, act)]);
}

async function refreshSandboxes() {
  const body = $("#sandboxes tbody");
  try {
    const { sandboxes } = await api("GET", "/sandboxes");
    body.replaceChildren();
    for (const sb of sandboxes) {
      const row = body.insertRow();
      row.dataset.id = sb.id;
      cell(row, sb.id, "mono");
      cell(row, sb.state, `state-${sb.state}`).dataset.role = "state";
      cell(row, sb.image);
      cell(row, `${sb.vcpus} vCPU, ${sb.memory_mib} MiB, disk ${sb.disk_mib} MiB` +
                (sb.desktop ? `, screen ${sb.desktop}` : ""));
      cell(row, age(sb.created_at)).title = new Date(sb.created_at * 1000).toLocaleString();
      const open = row.insertCell();
      if (sb.state === "running") {
        button(open, "Terminal", "terminal", () => openTerminal(sb.id));
      }
      if (sb.network && sb.network.egress !== "none") {
        button(open, "Egress", "egress", () => openDetail(sb.id, "Egress rules"));
      }
      if (sb.desktop) {
        button(open, "View", "view", () => openDesktop(sb.id, false));
        button(open, "View only", "view-only", () => openDesktop(sb.id, true));
      }
      const acts = row.insertCell();
      button(acts, "Snapshot", "snapshot", () => act(`Snapshot of ${sb.id}`,
        () => api("POST", `/sandboxes/${enc(sb.id)}/snapshot`)));
      button(acts, "Delete", "delete", () => {
        if (!confirm(`Delete sandbox ${sb.id} and everything in it?`)) return;
        if (detailId === sb.id) closeDetail();
        act(`Delete ${sb.id}`, () => api("DELETE", `/sandboxes/${enc(sb.id)}`));
      });
    }
    status("#list-status", "ok",
           `${sandboxes.length} ${sandboxes.length === 1 ? "sandbox" : "sandboxes"}`);
  } catch (e) {
    status("#list-status", "error", `Cannot list sandboxes: ${e.message}`);
  }
}

async function refreshMachines() {
  const body = $("#machines tbody");
  try {
    const { machines } = await api("GET", "/machines");
    body.replaceChildren();
    for (const m of machines) {
      const row = body.insertRow();
      row.dataset.user = m.user_id;
      cell(row, m.user_id);
      cell(row, m.state + (m.desired_state !== m.state && m.desired_state !== "active"
                           ? ` → ${m.desired_state}` : ""), `state-${m.state}`);
      cell(row, m.sandbox_id, "mono");
      cell(row, `${Math.round(m.idle_timeout_s / 60)} min`);
      cell(row, `${age(m.last_active_at)} ago`);
      const acts = row.insertCell();
      const path = `/machines/${enc(m.user_id)}`;
      button(acts, "Sleep", "sleep", () => act(`Sleep ${m.user_id}`,
        () => api("POST", `${path}/snapshot`)));
      button(acts, "Wake", "wake", () => act(`Wake ${m.user_id}`,
        () => api("POST", `${path}/wake`)));
    }
  } catch (e) { body.replaceChildren(); }
}

async function refreshSnapshots() {
  const body = $("#snapshots tbody");
  try {
    const { snapshots } = await api("GET", "/snapshots");
    body.replaceChildren();
    for (const s of snapshots) {
      const row = body.insertRow();
      row.dataset.id = s.id;
      cell(row, s.id, "mono");
      cell(row, s.sandbox_id, "mono");
      cell(row, s.image);
      cell(row, bytes(s.size_bytes));
      cell(row, age(s.created_at));
      const acts = row.insertCell();
      button(acts, "Delete", "delete-snapshot", () => {
        if (confirm(`Delete snapshot ${s.id}?`)) {
          act(`Delete ${s.id}`, () => api("DELETE", `/snapshots/${enc(s.id)}`));
        }
      });
    }
  } catch (e) { body.replaceChildren(); }
}

async function refreshPool() {
  try {
    const [p, h] = await Promise.all([api("GET", "/pool"), api("GET", "/health")]);
    const per = Object.entries(p.templates || {}).map(([t, n]) => `${t} ${n}`).join(", ");
    $("#pool").textContent = `pool: ${p.ready} ready, ${p.starting} starting` +
                             (per ? ` (keeps ${per})` : "");
    $("#server-info").textContent =
      `version ${h.version}, ${h.engine.engine || "engine"} ${h.engine.accel || ""}`.trim();
  } catch (e) { $("#pool").textContent = ""; }
  try {  // the operator's: a team's key gets 403 and sees no limits
    const c = await api("GET", "/capacity");
    const st = c.starts;
    $("#limits").textContent = `· ${c.vmms}/${c.vmm_limit} live, ` +
      `${st.running}/${st.limit} starting, ${st.queued}/${st.queue} queued`;
  } catch (e) { $("#limits").textContent = ""; }
}

// Runs fn, reporting in `where` (the sandboxes' status line unless a section has its own).
async function act(what, fn, where = "#list-status") {
  status(where, "busy", `${what}…`);
  try {
    await fn();
    status(where, "ok", `${what}: done`);
  } catch (e) {
    status(where, "error", `${what}: ${e.message}`);
  }
  refresh();
}

async function create(ev) {
  ev.preventDefault();
  const body = {};
  const image = $("#create-image").value.trim();
  const vcpus = parseInt($("#create-vcpus").value, 10);
  const memory = parseInt($("#create-memory").value, 10);
  const desktop = $("#create-desktop").value.trim();
  if (image) body.image = image;
  if (vcpus) body.vcpus = vcpus;
  if (memory) body.memory_mib = memory;
  if (desktop) body.desktop = desktop;
  await act("Create", () => api("POST", "/sandboxes", body,
                                { "Idempotency-Key": crypto.randomUUID() }));
}

// -- one sandbox: terminal, desktop, ports ----------------------------------------------------

function openDetail(id, title) {
  closeDetail();
  detailId = id;
  $("#detail-section").hidden = false;
  $("#detail-title").textContent = title;
  $("#detail-id").textContent = id;
  showPorts($("#ports"), id, headers());
  $("#network-status").textContent = "";
  showNetwork($("#network"), id, api, act);
}

function closeDetail() {
  closeTerminal();
  if (rfb) { rfb.disconnect(); rfb = null; }
  $("#screen").replaceChildren();
  $("#terminal").replaceChildren();
  $("#terminal-pane").hidden = true;
  $("#viewer-pane").hidden = true;
  $("#detail-section").hidden = true;
  detailId = null;
}

function closeTerminal() {
  if (!terminal) return;
  const t = terminal;
  terminal = null;
  t.closed = true;
  if (t.ws) t.ws.close();
  // The session outlives its viewer for its grace period; hang it up now.
  api("DELETE", `/sandboxes/${enc(t.sandbox)}/pty/${enc(t.session)}`).catch(() => {});
  t.term.destroy();
}

function loadStylesheet(href) {
  if (document.querySelector(`link[href="${href}"]`)) return;
  const l = document.createElement("link");
  l.rel = "stylesheet";
  l.href = href;
  document.head.append(l);
}

async function openTerminal(id) {
  openDetail(id, "Terminal of");
  $("#terminal-pane").hidden = false;
  status("#terminal-status", "connecting", "Starting a shell…");
  let xterm;
  try {
    xterm = await import("/xterm/xterm.js");
  } catch (e) {
    status("#terminal-status", "error",
           "xterm.js is not available on this server (apt-get install node-xterm).");
    return;
  }
  loadStylesheet("/xterm/xterm.css");
  const term = new xterm.Terminal({ rendererType: "dom", cols: 100, rows: 30,
                                    fontFamily: "monospace", fontSize: 14 });
  term.open($("#terminal"));
  try { xterm.fit(term); } catch (e) { /* keep 100x30 */ }
  let session;
  try {
    session = await api("POST", `/sandboxes/${enc(id)}/pty`,
                        { cols: term.cols, rows: term.rows, grace: 120 });
  } catch (e) {
    term.destroy();
    status("#terminal-status", "error", `Cannot start a shell: ${e.message}`);
    return;
  }
  const t = { term, ws: null, sandbox: id, session: session.id, received: 0, closed: false,
              tries: 0, decoder: new TextDecoder() };
  terminal = t;
  const encoder = new TextEncoder();
  term.on("data", (data) => {
    if (t.ws && t.ws.readyState === WebSocket.OPEN) t.ws.send(encoder.encode(data));
  });
  term.on("resize", ({ cols, rows }) => {
    if (t.ws && t.ws.readyState === WebSocket.OPEN) {
      t.ws.send(JSON.stringify({ type: "resize", cols, rows }));
    }
  });
  await attachTerminal(t);
  term.focus();
}

async function attachTerminal(t) {
  let ticket;
  try {
    ticket = await api("POST", `/sandboxes/${enc(t.sandbox)}/pty/${enc(t.session)}/tickets`);
  } catch (e) {
    status("#terminal-status", "error", `Terminal closed: ${e.message}`);
    return;
  }
  if (t.closed) return;
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const ws = new WebSocket(`${scheme}://${location.host}${ticket.url}&offset=${t.received}`);
  ws.binaryType = "arraybuffer";
  t.ws = ws;
  let exited = false;
  ws.addEventListener("message", (ev) => {
    if (typeof ev.data !== "string") {
      t.received += ev.data.byteLength;
      t.term.write(t.decoder.decode(new Uint8Array(ev.data), { stream: true }));
      return;
    }
    const msg = JSON.parse(ev.data);
    if (msg.type === "attached") {
      t.tries = 0;
      status("#terminal-status", "connected", "Connected");
    } else if (msg.type === "exit") {
      exited = true;
      status("#terminal-status", "exited", `The shell exited (code ${msg.exit_code}).`);
    }
  });
  ws.addEventListener("close", () => {
    if (t.closed || exited || terminal !== t) return;
    if (t.tries >= 5) { status("#terminal-status", "error", "Connection lost."); return; }
    t.tries += 1;
    status("#terminal-status", "connecting", "Connection lost; attaching again…");
    setTimeout(() => { if (!t.closed) attachTerminal(t); }, 1000);
  });
}

async function openDesktop(id, viewOnly) {
  openDetail(id, viewOnly ? "Desktop (view only) of" : "Desktop of");
  $("#viewer-pane").hidden = false;
  status("#viewer-status", "connecting", "Connecting…");
  let RFB;
  try {
    ({ default: RFB } = await import("/novnc/core/rfb.js"));
  } catch (e) {
    status("#viewer-status", "error", "noVNC is not available on this server (apt-get install novnc).");
    return;
  }
  try {
    // The ticket is single use and valid for 30 s: fetch it right before connecting.
    const t = await api("POST", `/sandboxes/${enc(id)}/vnc/tickets`, { view_only: viewOnly });
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    rfb = new RFB($("#screen"), `${scheme}://${location.host}${t.url}`,
                  { shared: true, wsProtocols: ["binary"] });
    rfb.viewOnly = viewOnly;
    rfb.scaleViewport = true;
    rfb.resizeSession = false;
    rfb.addEventListener("connect", () => status("#viewer-status", "connected", "Connected"));
    rfb.addEventListener("disconnect", (ev) => status("#viewer-status",
      "disconnected", ev.detail.clean ? "Disconnected" : "Connection lost"));
    rfb.addEventListener("securityfailure", (ev) => status("#viewer-status",
      "error", `Refused: ${ev.detail.reason || ev.detail.status}`));
  } catch (e) {
    status("#viewer-status", "error", `Cannot connect: ${e.message}`);
  }
}

// -- live events and agent tasks --------------------------------------------------------------

function describe(ev) {
  const d = ev.data || {};
  switch (ev.kind) {
    case "exec.finished": return `exec finished: exit ${d.exit_code} in ${d.duration_s} s`;
    case "agent.task.starting": return `task ${d.name || d.task_id} starting (${d.tier}): asking for its VM`;
    case "agent.task.started": return `task ${d.name || d.task_id} started (${d.tier})`;
    case "agent.task.ended": return `task ${d.name || d.task_id} ended: ${d.reason || ""}`;
    case "agent.tool.started": return `tool ${d.tool}: ${d.summary || ""}`;
    case "pty.opened": return `terminal ${d.session} opened (${d.program})`;
    case "pty.closed": return `terminal ${d.session} closed: exit ${d.exit_code}`;
    case "egress.denied":
      return `egress denied (${d.via}): ${d.domain || d.address || ""}:${d.port} ${d.reason}` +
             (d.repeats ? ` (+${d.repeats})` : "");
    case "secret.refused": return `secret ${d.secret} refused for ${d.host}: ${d.reason}`;
    case "volume.created": return `volume ${d.volume_id} created (${d.size_mib} MiB)`;
    case "volume.deleted": return `volume ${d.volume_id} deleted`;
    case "template.build.started": return `template ${d.template}: build started (${d.steps} steps)`;
    case "template.build.sandbox": return `template ${d.template}: build sandbox up`;
    case "template.build.step": return `template ${d.template}: step ${d.step}/${d.of} ${d.instruction}`;
    case "template.build.ready": return `template ${d.template}: build ready`;
    case "template.build.failed": return `template ${d.template}: build failed at step ${d.step}`;
    default: return ev.kind;
  }
}

function onEvent(ev) {
  const li = document.createElement("li");
  li.dataset.kind = ev.kind;
  const when = new Date(ev.time * 1000).toLocaleTimeString();
  li.textContent = `${when}  ${ev.sandbox_id || ""}  ${describe(ev)}`;
  const list = $("#events");
  list.prepend(li);
  while (list.children.length > 200) list.lastElementChild.remove();
  const d = ev.data || {};
  if (ev.kind === "agent.task.started" && d.task_id) {
    tasks.set(d.task_id, { name: d.name || d.task_id, tier: d.tier || "", started: ev.time,
                           sandbox: d.sandbox_id || ev.sandbox_id || "", doing: "" });
  } else if (ev.kind === "agent.task.ended") {
    tasks.delete(d.task_id);
  } else if (ev.kind === "agent.tool.started" && tasks.has(d.task_id)) {
    tasks.get(d.task_id).doing = `${d.tool}: ${d.summary || ""}`;
  } else if (ev.kind === "agent.tool.finished" && tasks.has(d.task_id)) {
    tasks.get(d.task_id).doing = "";
  }
  renderTasks();
  if (/^(sandbox|machine|snapshot|pool)\./.test(ev.kind)) refreshSoon();
}

function renderTasks() {
  const body = $("#tasks tbody");
  body.replaceChildren();
  for (const [id, t] of tasks) {
    const row = body.insertRow();
    row.dataset.task = id;
    cell(row, t.name);
    cell(row, t.tier, `tier-${t.tier}`);
    cell(row, t.sandbox, "mono");
    cell(row, t.doing);
    cell(row, age(t.started));
  }
}

let refreshTimer = null;
function refreshSoon() {
  if (refreshTimer) return;
  refreshTimer = setTimeout(() => { refreshTimer = null; refresh(); }, 300);
}

async function followEvents() {
  if (eventsAbort) eventsAbort.abort();
  const ctl = new AbortController();
  eventsAbort = ctl;
  // An id of another stream replays the server's ring of recent events first, so agent
  // tasks that started before the page opened are shown too.
  let last = "replay:0";
  while (!ctl.signal.aborted && apiKey()) {
    try {
      const r = await fetch("/events", { headers: headers({ "Accept": "text/event-stream",
                                                            "Last-Event-ID": last }),
                                         signal: ctl.signal, cache: "no-store" });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      status("#events-status", "connected", "live");
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:"))
                            .map((l) => l.slice(5).trim()).join("\n");
          if (!data) continue;
          const ev = JSON.parse(data);
          last = ev.id;
          onEvent(ev);
        }
      }
    } catch (e) {
      if (ctl.signal.aborted) return;
      status("#events-status", "error", `reconnecting (${e.message})`);
    }
    await new Promise((res) => setTimeout(res, 2000));
  }
}

// -- the key ----------------------------------------------------------------------------------

$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const v = $("#api-key").value.trim();
  if (v) sessionStorage.setItem(KEY, v);
  $("#api-key").value = "";
  $("#api-key").placeholder = apiKey() ? "a key is in use (paste another to replace it)"
                                       : "paste the key from <data dir>/api-key";
  refresh();
  followEvents();
});
$("#forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  if (eventsAbort) eventsAbort.abort();
  closeDetail();
  for (const sel of ["#sandboxes", "#machines", "#snapshots", "#tasks", "#volumes", "#secrets"]) {
    $(`${sel} tbody`).replaceChildren();
  }
  $("#events").replaceChildren();
  tasks.clear();
  refresh();
});
$("#refresh").addEventListener("click", refresh);
$("#disconnect").addEventListener("click", closeDetail);
$("#create-form").addEventListener("submit", create);
$("#volume-form").addEventListener("submit", (ev) => { ev.preventDefault(); createVolume(api, act); });
$("#secret-form").addEventListener("submit", (ev) => { ev.preventDefault(); createSecret(api, act); });
window.addEventListener("resize", () => {
  if (terminal) import("/xterm/xterm.js").then((x) => { try { x.fit(terminal.term); } catch (e) {} });
});
setInterval(() => { if (apiKey()) { refresh(); renderTasks(); } }, 5000);
refresh();
if (apiKey()) followEvents();
