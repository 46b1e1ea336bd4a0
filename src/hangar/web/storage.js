// The dashboard's volumes, secrets and a sandbox's egress rules. Each function takes the
// app's `api(method, path, body)` (which sends the key header) and `act(what, fn)` (which
// reports and refreshes). A secret's value is sent once, from a password field that is
// cleared at once, and is never shown: the API returns names and hosts only.
const enc = encodeURIComponent;

function cell(row, text, cls) {
  const c = row.insertCell();
  c.textContent = text;
  if (cls) c.className = cls;
  return c;
}

function button(parent, label, action, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.dataset.action = action;
  b.addEventListener("click", onClick);
  parent.append(b);
  return b;
}

// Entries separated by commas (never by spaces: "exa mple.com" is one entry, which the
// server refuses with its reason).
function list(text) {
  return text.split(/[,\n]+/).map((s) => s.trim()).filter(Boolean);
}

export async function refreshVolumes(api, act) {
  const body = document.querySelector("#volumes tbody");
  try {
    const { volumes } = await api("GET", "/volumes");
    body.replaceChildren();
    for (const v of volumes) {
      const row = body.insertRow();
      row.dataset.id = v.id;
      cell(row, v.name);
      cell(row, v.id, "mono");
      cell(row, `${v.size_mib} MiB`);
      cell(row, v.attached.map((a) => `${a.sandbox_id}:${a.path}${a.read_only ? " (ro)" : ""}`)
                          .join(", ") || "—", "mono");
      const acts = row.insertCell();
      button(acts, "Delete", "delete-volume", () => {
        if (confirm(`Delete volume ${v.name} and its data?`)) {
          act(`Delete volume ${v.name}`, () => api("DELETE", `/volumes/${enc(v.id)}`),
              "#volumes-status");
        }
      });
    }
  } catch (e) { body.replaceChildren(); }
}

export async function createVolume(api, act) {
  const name = document.querySelector("#volume-name").value.trim();
  const size = parseInt(document.querySelector("#volume-size").value, 10);
  const body = { name };
  if (size) body.size_mib = size;
  await act(`Create volume ${name}`, () => api("POST", "/volumes", body), "#volumes-status");
}

export async function refreshSecrets(api, act) {
  const body = document.querySelector("#secrets tbody");
  try {
    const { secrets } = await api("GET", "/secrets");
    body.replaceChildren();
    for (const s of secrets) {
      const row = body.insertRow();
      row.dataset.name = s.name;
      cell(row, s.name, "mono");
      cell(row, (s.hosts || []).join(", "), "mono");
      const acts = row.insertCell();
      button(acts, "Delete", "delete-secret", () => {
        if (confirm(`Delete secret ${s.name}?`)) {
          act(`Delete secret ${s.name}`, () => api("DELETE", `/secrets/${enc(s.name)}`),
              "#secrets-status");
        }
      });
    }
  } catch (e) { body.replaceChildren(); }
}

export async function createSecret(api, act) {
  const field = document.querySelector("#secret-value");
  const value = field.value;
  field.value = "";
  const name = document.querySelector("#secret-name").value.trim();
  const hosts = list(document.querySelector("#secret-hosts").value);
  await act(`Store secret ${name}`, () => api("POST", "/secrets", { name, value, hosts }),
            "#secrets-status");
}

// A sandbox's egress rules (GET /sandboxes/{id} `network`), with a form that adds allow or
// deny entries at runtime (PATCH /sandboxes/{id}/network). Each section reports in its own
// status line (#volumes-status, #secrets-status, #network-status).
export async function showNetwork(target, sandboxId, api, act) {
  target.replaceChildren();
  let sb;
  try { sb = await api("GET", `/sandboxes/${enc(sandboxId)}`); } catch (e) { return; }
  const net = sb.network;
  if (!net || net.egress === "none") return;
  const text = document.createElement("span");
  text.dataset.role = "rules";
  text.textContent = `Egress: ${net.egress}; allow ${(net.allow || []).join(", ") || "—"}; ` +
                     `deny ${(net.deny || []).join(", ") || "—"} `;
  const input = document.createElement("input");
  input.id = "network-entry";
  input.placeholder = "*.example.com or 10.0.0.0/8";
  input.spellcheck = false;
  const change = (key) => async () => {
    const entries = list(input.value);
    if (!entries.length) return;
    const next = { allow: [...(net.allow || [])], deny: [...(net.deny || [])] };
    next[key].push(...entries);
    await act(`Egress of ${sandboxId}`,
              () => api("PATCH", `/sandboxes/${enc(sandboxId)}/network`, next),
              "#network-status");
    showNetwork(target, sandboxId, api, act);
  };
  target.append(text, input);
  button(target, "Allow", "network-allow", change("allow"));
  button(target, "Deny", "network-deny", change("deny"));
}
