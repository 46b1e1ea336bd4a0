// Hangar's web page: sandbox list and live desktop (noVNC). No inline script (CSP).
// The API key lives in sessionStorage and travels only in the X-API-Key header.
const KEY = "hangar.apiKey";
const $ = (sel) => document.querySelector(sel);
let rfb = null;

function apiKey() { return sessionStorage.getItem(KEY) || ""; }

async function api(method, path, body) {
  const headers = { "X-API-Key": apiKey() };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers, cache: "no-store",
                                body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((data.error && data.error.message) || `HTTP ${r.status}`);
  return data;
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

async function refresh() {
  const status = $("#list-status");
  const body = $("#sandboxes tbody");
  if (!apiKey()) { status.textContent = "Enter the API key to list sandboxes."; return; }
  try {
    const { sandboxes } = await api("GET", "/sandboxes");
    body.replaceChildren();
    for (const sb of sandboxes) {
      const row = body.insertRow();
      row.dataset.id = sb.id;
      cell(row, sb.id);
      cell(row, sb.state, `state-${sb.state}`).dataset.role = "state";
      cell(row, sb.image);
      cell(row, sb.desktop || "—");
      cell(row, new Date(sb.created_at * 1000).toLocaleString());
      const actions = row.insertCell();
      if (sb.desktop) {
        for (const [label, viewOnly] of [["View", false], ["View only", true]]) {
          const b = document.createElement("button");
          b.type = "button";
          b.textContent = label;
          b.dataset.action = viewOnly ? "view-only" : "view";
          b.addEventListener("click", () => connect(sb.id, viewOnly));
          actions.append(b);
        }
      }
    }
    status.textContent = `${sandboxes.length} ${sandboxes.length === 1 ? "sandbox" : "sandboxes"}`;
    status.className = "";
  } catch (e) {
    status.textContent = `Cannot list sandboxes: ${e.message}`;
    status.className = "error";
  }
}

function setViewerStatus(state, text) {
  const s = $("#viewer-status");
  s.dataset.state = state;
  s.textContent = text;
}

function disconnect() {
  if (rfb) { rfb.disconnect(); rfb = null; }
  $("#screen").replaceChildren();
  $("#viewer-section").hidden = true;
}

async function connect(id, viewOnly) {
  disconnect();
  $("#viewer-section").hidden = false;
  $("#viewer-id").textContent = id + (viewOnly ? " (view only)" : "");
  setViewerStatus("connecting", "Connecting…");
  let RFB;
  try {
    ({ default: RFB } = await import("/novnc/core/rfb.js"));
  } catch (e) {
    setViewerStatus("error", "noVNC is not available on this server (apt-get install novnc).");
    return;
  }
  try {
    // The ticket is single use and valid for 30 s: fetch it right before connecting.
    const t = await api("POST", `/sandboxes/${encodeURIComponent(id)}/vnc/tickets`,
                        { view_only: viewOnly });
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    rfb = new RFB($("#screen"), `${scheme}://${location.host}${t.url}`,
                  { shared: true, wsProtocols: ["binary"] });
    rfb.viewOnly = viewOnly;
    rfb.scaleViewport = true;
    rfb.resizeSession = false;
    rfb.addEventListener("connect", () => setViewerStatus("connected", "Connected"));
    rfb.addEventListener("disconnect", (ev) => setViewerStatus(
      "disconnected", ev.detail.clean ? "Disconnected" : "Connection lost"));
    rfb.addEventListener("securityfailure", (ev) => setViewerStatus(
      "error", `Refused: ${ev.detail.reason || ev.detail.status}`));
  } catch (e) {
    setViewerStatus("error", `Cannot connect: ${e.message}`);
  }
}

$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const v = $("#api-key").value.trim();
  if (v) sessionStorage.setItem(KEY, v);
  $("#api-key").value = "";
  $("#api-key").placeholder = apiKey() ? "a key is in use (paste another to replace it)"
                                       : "paste the key from <data dir>/api-key";
  refresh();
});
$("#forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  disconnect();
  $("#sandboxes tbody").replaceChildren();
  refresh();
});
$("#refresh").addEventListener("click", refresh);
$("#disconnect").addEventListener("click", disconnect);
setInterval(() => { if (apiKey()) refresh(); }, 5000);
refresh();
