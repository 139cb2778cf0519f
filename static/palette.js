// Colours and fill patterns shared by the chart, the batch bar and the chat panels.
// Okabe-Ito colours (safe for the common colour-vision deficiencies); the kind of
// a cell is never told by colour alone: decode is solid, prefill is striped with
// its token count, a stall is a dark cross-hatch.

// the chat panels' users, in panel order; the server side uses the same names and colours
const USERS = [
  ["Alice", "#E69F00"], ["Bob", "#56B4E9"], ["Carol", "#009E73"], ["Dan", "#CC79A7"],
  ["Eve", "#0072B2"], ["Frank", "#D55E00"], ["Grace", "#F0E442"], ["Heidi", "#7F7F7F"],
];
const BY_NAME = new Map(USERS.map(([n, c]) => [n.toLowerCase(), c]));
const OTHERS = ["#5A5A5A", "#8C8C8C", "#3F3F3F", "#A6A6A6"];   // labels the room has not numbered (yet)
const MARKS = 10;           // white marks on a label's swatch: slot // 8 picks one (app/serving/room.py: SLOT_SIGNS)

// the chart's inks, in one place
export const colors = {
  ink: "#111", paper: "#fff", soft: "#444", muted: "#666", rule: "#999", queued: "#555", stallLine: "#222",
  stripe: "#f7f7f7", gap: "rgba(0,0,0,.06)", labelBack: "rgba(255,255,255,.85)", mineBand: "#fff1c1",
  laneBand: "#e3e3e3", handover: "#111",   // a worker's lane header; a KV hand-over arrow (black on a white halo)
};

// the room numbers every label it sees (app/serving/room.py); slot -> Okabe-Ito colour + mark
const slots = new Map();
const unknown = new Set();
export function setSlots(bySlot) {
  for (const [label, slot] of Object.entries(bySlot)) { slots.set(label, slot); unknown.delete(label); }
}
export const unknownLabels = () => [...unknown];

// WCAG 2.x relative luminance and contrast ratio of two "#rrggbb" colours
const full = (hex) => (hex.length === 4 ? "#" + [...hex.slice(1)].map((c) => c + c).join("") : hex);   // "#fff"
function luminance(hex) {
  const n = parseInt(full(hex).slice(1), 16);
  const lin = (c) => (c /= 255) <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
  return 0.2126 * lin((n >> 16) & 255) + 0.7152 * lin((n >> 8) & 255) + 0.0722 * lin(n & 255);
}
export function contrast(a, b) {
  const la = luminance(a), lb = luminance(b);
  return (Math.max(la, lb) + 0.05) / (Math.min(la, lb) + 0.05);
}

// the backgrounds a mark sits on: the paper, a striped row, the student's own row
export const BACKGROUNDS = () => [colors.paper, colors.stripe, colors.mineBand];
export const MARK_CONTRAST = 3;       // WCAG 1.4.11: a chart mark against what is next to it

// the edge of a mark in this colour: the colour itself where it reaches 3:1 on every background, else
// the colour darkened (kept in hue) until it does; Okabe-Ito's light colours (orange, sky blue, yellow) need it
const edges = new Map();
export function edgeOf(hex) {
  if (!edges.has(hex)) {
    const n = parseInt(hex.slice(1), 16);
    let edge = hex;
    for (let k = 1; k <= 20 && BACKGROUNDS().some((b) => contrast(edge, b) < MARK_CONTRAST); k++) {
      const f = 1 - k * 0.05;
      edge = "#" + [16, 8, 0].map((sh) => Math.round(((n >> sh) & 255) * f).toString(16).padStart(2, "0")).join("");
    }
    edges.set(hex, edge);
  }
  return edges.get(hex);
}

// ink that reads on a fill of this colour (text drawn on a cell)
export function inkOn(hex) {
  const n = parseInt(hex.slice(1), 16);
  const r = (n >> 16) & 255, g = (n >> 8) & 255, b = n & 255;
  return 0.299 * r + 0.587 * g + 0.114 * b > 150 ? colors.ink : colors.paper;
}

export function colorOf(label) {
  const text = String(label || ""), key = text.toLowerCase();
  if (slots.has(text)) return USERS[slots.get(text) % USERS.length][1];
  if (BY_NAME.has(key)) return BY_NAME.get(key);
  if (text) unknown.add(text);
  const base = key.split(/[\s·#:-]/)[0];          // "Alice 2" or "alice-doc" keep Alice's colour until numbered
  if (BY_NAME.has(base)) return BY_NAME.get(base);
  let h = 0;
  for (const ch of key) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return OTHERS[h % OTHERS.length];
}

export const markOf = (label) => (slots.has(String(label)) ? Math.floor(slots.get(String(label)) / USERS.length) % MARKS : 0);

// a row's swatch: its colour, and past the eight colours a mark that tells equal colours apart
export function drawLabelSwatch(g, label, x, y, w, h) {
  const color = colorOf(label), mark = markOf(label);
  g.fillStyle = color; g.fillRect(x, y, w, h);
  if (!mark) return;
  const cx = x + w / 2, cy = y + h / 2, r = Math.min(w, h) * 0.32;
  g.save();
  g.fillStyle = g.strokeStyle = inkOn(color); g.lineWidth = Math.max(1.5, r * 0.5);
  g.beginPath();
  switch (mark) {
    case 1: g.arc(cx, cy, r * 0.7, 0, 2 * Math.PI); g.fill(); break;                          // dot
    case 2: g.fillRect(x + 1, cy - r * 0.35, w - 2, r * 0.7); break;                          // bar
    case 3: g.fillRect(cx - r * 0.35, y + 1, r * 0.7, h - 2); break;                          // post
    case 4: g.moveTo(cx - r, cy); g.lineTo(cx + r, cy); g.moveTo(cx, cy - r); g.lineTo(cx, cy + r); g.stroke(); break;   // plus
    case 5: g.moveTo(cx - r, cy - r); g.lineTo(cx + r, cy + r); g.moveTo(cx + r, cy - r); g.lineTo(cx - r, cy + r); g.stroke(); break;  // cross
    case 6: g.arc(cx, cy, r, 0, 2 * Math.PI); g.lineWidth = Math.max(1.2, r * 0.35); g.stroke(); break;   // ring
    case 7: g.moveTo(cx, cy - r); g.lineTo(cx + r, cy + r); g.lineTo(cx - r, cy + r); g.closePath(); g.fill(); break;  // triangle
    case 8: g.moveTo(cx, cy - r); g.lineTo(cx + r, cy); g.lineTo(cx, cy + r); g.lineTo(cx - r, cy); g.closePath(); g.fill(); break;  // diamond
    case 9: g.fillRect(x + 1, y + 1, w - 2, r * 0.6); g.fillRect(x + 1, y + h - 1 - r * 0.6, w - 2, r * 0.6); break;  // two bars
  }
  g.restore();
}

const cache = new Map();

function tile(draw, size) {
  const c = document.createElement("canvas");
  c.width = c.height = size;
  draw(c.getContext("2d"), size);
  return c;
}

// prefill: stripes of the user's colour on a pale tint of it
export function prefillPattern(ctx, color) {
  const key = "p" + color;
  if (!cache.has(key)) {
    cache.set(key, tile((g, s) => {
      g.fillStyle = color; g.globalAlpha = 0.28; g.fillRect(0, 0, s, s); g.globalAlpha = 1;
      g.strokeStyle = color; g.lineWidth = 3;
      g.beginPath();
      for (let k = -s; k <= s; k += s / 2) { g.moveTo(k, s); g.lineTo(k + s, 0); }
      g.stroke();
    }, 10));
  }
  return ctx.createPattern(cache.get(key), "repeat");
}

// a prefill's cached part (read from the prefix cache, not computed): dots of the user's colour on white
export function cachedPattern(ctx, color) {
  const key = "c" + color;
  if (!cache.has(key)) {
    cache.set(key, tile((g, s) => {
      g.fillStyle = "#ffffff"; g.fillRect(0, 0, s, s);
      g.fillStyle = color; g.beginPath(); g.arc(s / 2, s / 2, 1.6, 0, 2 * Math.PI); g.fill();
    }, 6));
  }
  return ctx.createPattern(cache.get(key), "repeat");
}

// stall: dark cross-hatch on pale grey, the same for everyone
export function stallPattern(ctx) {
  if (!cache.has("stall")) {
    cache.set("stall", tile((g, s) => {
      g.fillStyle = "#e4e4e4"; g.fillRect(0, 0, s, s);
      g.strokeStyle = "#222"; g.lineWidth = 1.6;
      g.beginPath(); g.moveTo(0, 0); g.lineTo(s, s); g.moveTo(s, 0); g.lineTo(0, s); g.stroke();
    }, 8));
  }
  return ctx.createPattern(cache.get("stall"), "repeat");
}

// unused budget in the batch bar
export function unusedPattern(ctx) {
  if (!cache.has("unused")) {
    cache.set("unused", tile((g, s) => {
      g.fillStyle = "#f6f6f6"; g.fillRect(0, 0, s, s);
      g.fillStyle = "#c8c8c8"; g.fillRect(0, 0, 1.5, 1.5);
    }, 4));
  }
  return ctx.createPattern(cache.get("unused"), "repeat");
}

// legend swatches are small canvases drawn with the same patterns
export function drawSwatches(root) {
  (root || document).querySelectorAll("canvas[data-swatch]").forEach((c) => {
    const g = c.getContext("2d"), w = c.width, h = c.height, kind = c.dataset.swatch;
    g.clearRect(0, 0, w, h);
    const color = "#0072B2";
    if (kind === "decode") { g.fillStyle = color; g.fillRect(0, 0, w, h); }
    else if (kind === "prefill") {
      g.fillStyle = prefillPattern(g, color); g.fillRect(0, 0, w, h);
      g.fillStyle = "#111"; g.font = "bold 11px sans-serif"; g.textAlign = "center"; g.textBaseline = "middle";
      g.fillText("P", w / 2, h / 2 + 1);
    } else if (kind === "cached") {
      g.fillStyle = cachedPattern(g, color); g.fillRect(0, 0, w, h);
      g.setLineDash([3, 2]); g.strokeStyle = color; g.lineWidth = 1.5; g.strokeRect(1, 1, w - 2, h - 2);
      g.setLineDash([]);
    } else if (kind === "stall") {
      g.fillStyle = stallPattern(g); g.fillRect(0, 0, w, h);
      g.strokeStyle = "#222"; g.lineWidth = 2; g.strokeRect(1, 1, w - 2, h - 2);
    } else if (kind === "queued") {
      g.strokeStyle = "#555"; g.setLineDash([3, 3]); g.lineWidth = 2;
      g.beginPath(); g.moveTo(0, h / 2); g.lineTo(w, h / 2); g.stroke();
    } else if (kind === "handover") {
      g.strokeStyle = g.fillStyle = "#111"; g.lineWidth = 2.5;
      g.beginPath(); g.arc(4, 3.5, 2.5, 0, 2 * Math.PI); g.fill();
      g.beginPath(); g.moveTo(4, 3.5); g.lineTo(w - 5, h - 4); g.stroke();
      g.beginPath(); g.moveTo(w - 2, h - 2); g.lineTo(w - 10, h - 5); g.lineTo(w - 6, h - 10); g.closePath(); g.fill();
    } else if (kind === "drafts") {       // as draw.js drawDrafts: own token, a kept draft (dot), a rejected one (cross)
      const sw = w / 3;
      g.fillStyle = color; g.fillRect(0, 0, 2 * sw - 1, h);
      g.fillStyle = "#fff"; g.beginPath(); g.arc(1.5 * sw, h / 2, 2.5, 0, 2 * Math.PI); g.fill();
      g.strokeStyle = color; g.lineWidth = 1.5; g.strokeRect(2 * sw + 0.75, 0.75, sw - 1.5, h - 1.5);
      g.beginPath(); g.moveTo(2 * sw + 2, h / 2 - 3); g.lineTo(w - 2, h / 2 + 3); g.moveTo(w - 2, h / 2 - 3);
      g.lineTo(2 * sw + 2, h / 2 + 3); g.stroke();
    } else if (kind === "marker") {
      g.fillStyle = "#111"; g.fillRect(w / 2 - 1.5, 0, 3, h);
    }
  });
}
