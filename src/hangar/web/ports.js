// A sandbox's exposed ports as links, from GET /sandboxes/{id}/ports (a JSON list of
// {port, public, url, signed_url}): a private port links its signed URL (a token for that
// port only, never the API key), opened without a referrer or an opener. Any error shows
// nothing.
export async function showPorts(target, sandboxId, headers) {
  target.replaceChildren();
  let list;
  try {
    const r = await fetch(`/sandboxes/${encodeURIComponent(sandboxId)}/ports`,
                          { headers, cache: "no-store" });
    if (!r.ok) return;
    const data = await r.json();
    list = Array.isArray(data) ? data : (data && data.ports) || [];
  } catch (e) {
    return;
  }
  const links = [];
  for (const p of list) {
    if (!p || !Number.isInteger(p.port) || typeof p.url !== "string") continue;
    const href = !p.public && typeof p.signed_url === "string" ? p.signed_url : p.url;
    let url;
    try { url = new URL(href, location.href); } catch (e) { continue; }
    if (url.protocol !== "http:" && url.protocol !== "https:") continue;
    const a = document.createElement("a");
    a.href = url.href;
    a.target = "_blank";
    a.rel = "noopener noreferrer";
    a.textContent = `${p.port}${p.public ? " (public)" : ""}`;
    a.dataset.port = String(p.port);
    links.push(a);
  }
  if (!links.length) return;
  target.append("Ports: ");
  links.forEach((a, i) => { if (i) target.append(" "); target.append(a); });
}
