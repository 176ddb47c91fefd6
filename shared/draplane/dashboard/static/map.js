// The device map: rows and pending pods from /events (server-sent events), drawn as plain DOM.
// Each `map` event carries the rows that changed since the last one this page was sent, the order
// of all rows, and the pending list, totals and status whole. EventSource reconnects by itself;
// the server then sends every row again.
"use strict";

const rows = new Map();      // node -> row as the server sent it
const rowElements = new Map();
const cells = new Map();     // cell id -> {row, cell}, for the inspector
let selected = null;         // the cell id the inspector shows


const mapElement = document.getElementById("map");
const statusElement = document.getElementById("status");

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function score(holder) {
  if (holder.score === undefined || holder.score === null) return holder.policy ? `${holder.policy}, no score` : "unknown";
  return `${holder.policy || "policy"} ${Number(holder.score).toFixed(2)}`;
}

function cellTitle(row, cell) {
  const lines = [`${cell.device} on ${row.name}`, `state: ${cell.state}`];
  if (cell.detail) lines.push(cell.detail);
  for (const holder of cell.holders || []) {
    lines.push(`claim ${holder.claim}${holder.share ? ` (share ${holder.share})` : ""}`);
    lines.push(`pod ${holder.pod}`);
    lines.push(`score ${score(holder)}${holder.lease ? " (reserved, being written)" : ""}`);
  }
  for (const taint of cell.taints || []) lines.push(`taint ${taint}`);
  return lines.join("\n");
}

function drawRow(row) {
  const counts = {};
  for (const cell of row.cells) counts[cell.state] = (counts[cell.state] || 0) + 1;
  const summary = `${row.cells.length} devices` + (counts.allocated ? ` · ${counts.allocated} allocated` : "")
    + (counts.shared ? ` · ${counts.shared} shared` : "");
  const name = element("div", {class: "name"}, row.name);
  if (row.kind === "pool") name.prepend("pool ");
  if (row.stale) name.append(" ", element("span", {class: "badge", title: "its node agent stopped heartbeating"}, "stale"));
  name.append(element("small", {}, summary));
  const groups = element("div", {class: "groups"});
  let group = null, groupName = null;
  for (const cell of row.cells) {
    if (cell.group !== groupName) {
      groupName = cell.group;
      group = element("div", {class: "group", "data-group": cell.group});
      groups.append(group);
    }
    const square = element("span", {
      class: `cell ${cell.state}`, "data-id": cell.id, "data-device": cell.device, "data-state": cell.state,
      title: cellTitle(row, cell), tabindex: "0",
    });
    if (cell.id === selected) square.classList.add("selected");
    group.append(square);
    cells.set(cell.id, {row, cell});
  }
  for (const g of groups.children) {
    // A counter set's group is one partitionable GPU: framed, its whole device drawn wide.
    const first = cells.get(g.firstChild.dataset.id).cell;
    if (g.children.length > 1 && first.group !== first.id.split("/")[0]) {
      g.classList.add("gpu");
      const whole = Array.from(g.children).find(c => !(cells.get(c.dataset.id).cell.detail || "").startsWith("MIG "));
      if (whole) whole.classList.add("whole");
    }
  }
  const body = element("div", {}, groups);
  if (row.note) body.append(element("div", {class: "note"}, row.note));
  return element("div", {class: "row", "data-node": row.name}, name, body);
}

function forgetCells(row) {
  for (const cell of row.cells) cells.delete(cell.id);
}

function applyMap(message) {
  for (const name of message.removed) {
    if (rows.has(name)) forgetCells(rows.get(name));
    rows.delete(name);
    rowElements.get(name)?.remove();
    rowElements.delete(name);
  }
  for (const row of message.rows) {
    if (rows.has(row.name)) forgetCells(rows.get(row.name));
    rows.set(row.name, row);
    const drawn = drawRow(row);
    rowElements.get(row.name)?.replaceWith(drawn);
    rowElements.set(row.name, drawn);
  }
  // A new connection is sent every row: rows this page still has but the order lacks are gone.
  const present = new Set(message.order);
  for (const name of Array.from(rows.keys())) {
    if (!present.has(name)) {
      forgetCells(rows.get(name));
      rows.delete(name);
      rowElements.get(name)?.remove();
      rowElements.delete(name);
    }
  }
  if (message.order.length === 0) {
    mapElement.replaceChildren(element("p", {class: "empty"}, "No devices in the inventory feed yet."));
  } else {
    mapElement.querySelector(".empty")?.remove();
    message.order.forEach((name, index) => {
      const node = rowElements.get(name);
      if (mapElement.children[index] !== node) mapElement.insertBefore(node, mapElement.children[index] || null);
    });
  }
  applyRest(message.rest);
  inspect(selected);
}

function age(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  if (seconds < 60) return `${seconds} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${seconds % 60} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.floor(seconds % 3600 / 60)} min`;
}

function applyRest(rest) {

  for (const [state, count] of Object.entries(rest.totals)) {
    const total = document.querySelector(`[data-total="${state}"]`);
    if (total) total.textContent = count;
  }
  const live = rest.status.nats === "connected";
  statusElement.dataset.state = live ? "live" : rest.status.nats;
  statusElement.textContent = live
    ? `live · ${new Date(rest.at * 1000).toLocaleTimeString()}` + (rest.status.synced ? "" : " · reading NATS")
    : `NATS ${rest.status.nats}…`;
  const list = document.getElementById("pending");
  const items = rest.pending.pods.map(entry => {
    const when = [entry.since ? `pending ${age(rest.at - entry.since)}` : "pending",
                  entry.decided_by ? `decided by ${entry.decided_by}` : null,
                  entry.quiet ? `not heard of for ${age(rest.at - entry.heard)} (deleted, or waiting)` : null]
      .filter(Boolean).join(" · ");
    return element("li", {class: entry.quiet ? "quiet" : "", "data-pod": entry.pod, "data-uid": entry.uid},
      element("span", {class: "pod"}, entry.pod),
      element("span", {class: "reason"}, entry.reason),
      element("span", {class: "when"}, when));
  });
  if (rest.pending.more) items.push(element("li", {class: "more"}, `and ${rest.pending.more} more`));
  if (items.length === 0) items.push(element("li", {class: "empty"}, "None."));
  list.replaceChildren(...items);
  document.getElementById("pending-count").textContent = rest.pending.pods.length + rest.pending.more;
}

function inspect(id) {
  const panel = document.getElementById("inspector");
  const found = id && cells.get(id);
  if (!found) {
    panel.replaceChildren(element("h2", {}, "Device"), element("p", {class: "empty"}, "Point at a device."));
    return;
  }
  const {row, cell} = found;
  const facts = element("dl", {},
    element("dt", {}, "device"), element("dd", {}, cell.id),
    element("dt", {}, "node"), element("dd", {}, row.name),
    element("dt", {}, "state"), element("dd", {"data-field": "state"}, cell.state));
  if (cell.detail) facts.append(element("dt", {}, "what"), element("dd", {}, cell.detail));
  for (const taint of cell.taints || []) facts.append(element("dt", {}, "taint"), element("dd", {}, taint));
  const holders = (cell.holders || []).map(holder => element("dl", {class: "holder"},
    element("dt", {}, "claim"), element("dd", {"data-field": "claim"}, holder.claim + (holder.share ? ` (share ${holder.share})` : "")),
    element("dt", {}, "pod"), element("dd", {"data-field": "pod"}, holder.pod),
    element("dt", {}, "score"), element("dd", {"data-field": "score"}, score(holder)),
    element("dt", {}, "held"), element("dd", {}, holder.lease ? "reserved, being written to the claim" : "allocated")));
  panel.replaceChildren(element("h2", {}, "Device"), facts, ...holders);
}

function choose(event) {
  const square = event.target.closest(".cell");
  if (!square) return;
  document.querySelector(".cell.selected")?.classList.remove("selected");
  square.classList.add("selected");
  selected = square.dataset.id;
  inspect(selected);
}
mapElement.addEventListener("mouseover", choose);
mapElement.addEventListener("focusin", choose);

const source = new EventSource("events");
source.addEventListener("map", event => applyMap(JSON.parse(event.data)));
source.addEventListener("error", () => {
  statusElement.dataset.state = "reconnecting";
  statusElement.textContent = "dashboard unreachable, reconnecting…";
});
