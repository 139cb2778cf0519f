// The classroom on every page: colours for every label (numbered by the server, GET /api/room),
// and on the student page the one chat (join with a name, send, read the reply as it streams).
// A student's token lives in this tab's sessionStorage; the server decides what it allows.
import { lang, setLang, t } from "./i18n.js";
import { redrawChart } from "./interact.js";
import { mine } from "./layout.js";
import { setSlots, unknownLabels } from "./palette.js";
import { url } from "./socket.js";
import { state } from "./state.js";

const KEY = "batchscope.room";
// the projector draws the chart up to 1.8x (at 1080 px high its smallest text is 16 px, docs/ui.md), less
// on a lower screen, so that chart, batch bar and metrics share it
const projectorScale = () => Math.max(1.1, Math.min(1.8, window.innerHeight / 600));
let root, asking = false, lastAsk = 0, me = null, busy = false;

const $ = (id) => root.querySelector("[data-testid=" + id + "]");

async function getJSON(path, opts) {
  const r = await fetch(url(path), Object.assign({ cache: "no-store" }, opts));
  let body = null;
  try { body = await r.json(); } catch (e) { /* not JSON */ }
  return { ok: r.ok, status: r.status, body };
}

const errorText = (res) => (res.body && res.body.error && res.body.error.message) || "HTTP " + res.status;

// ---- label slots: asked for when the chart meets a label it cannot colour yet ----
async function askRoom() {
  asking = true;
  try {
    const res = await getJSON("/api/room");
    if (res.ok) {
      setSlots(res.body.labels);
      const count = $("room-count");
      if (count) count.textContent = String(res.body.people);
      redrawChart();
    }
  } catch (e) { /* offline: the socket says so */ }
  asking = false;
}

export function roomFrame(now) {
  if (asking || now - lastAsk < 1000) return;
  if (!unknownLabels().length && !(state.role === "projector" && now - lastAsk > 5000)) return;
  lastAsk = now;
  askRoom();
}

// ---- the student's chat ----
function saved() { try { return JSON.parse(sessionStorage.getItem(KEY) || "null"); } catch (e) { return null; } }
function save(v) { try { sessionStorage.setItem(KEY, JSON.stringify(v)); } catch (e) { /* private mode */ } }

function showError(id, text) { const el = $(id); el.textContent = text || ""; el.hidden = !text; }

function setMe(member) {
  me = member;
  save({ token: me.token, label: me.label });
  $("my-label").textContent = me.label;
  $("you-are").hidden = false;
  $("student-name").value = me.label;
  $("join").textContent = t("room.rename");
  $("join").dataset.i18n = "room.rename";
  $("leave").hidden = false;
  redrawChart();
}

// leaving frees this student's place in the room (a streaming reply is aborted); the label stays
// taken on the chart, so joining again gives a new one
async function leave() {
  showError("join-error", "");
  if (!me) return;
  const res = await getJSON("/api/room/leave", { method: "POST", headers: { "X-Room-Token": me.token } });
  if (!res.ok && res.status !== 401) { showError("join-error", errorText(res)); return; }
  me = null;
  save(null);
  $("you-are").hidden = true;
  $("leave").hidden = true;
  $("join").textContent = t("room.join");
  $("join").dataset.i18n = "room.join";
  $("join").focus();
  redrawChart();
  askRoom();
}

async function join() {
  showError("join-error", "");
  const res = await getJSON("/api/room/join", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ name: $("student-name").value, token: me ? me.token : undefined }) });
  if (!res.ok) { showError("join-error", errorText(res)); return; }
  setMe(res.body);
  askRoom();
}

function bubble(who, text) {
  const row = document.createElement("div");
  row.className = "bs-msg bs-msg-" + who;
  row.dataset.who = who;
  const name = document.createElement("b");
  name.dataset.i18n = who === "me" ? "room.me" : "room.bot";
  name.textContent = t(name.dataset.i18n);
  const body = document.createElement("span");
  body.textContent = text;
  row.append(name, body);
  $("student-chat").append(row);
  return body;
}

async function send(ev) {
  ev.preventDefault();
  showError("chat-error", "");
  if (!me) { showError("chat-error", t("room.join_first")); return; }
  if (busy) { showError("chat-error", t("room.waiting")); return; }
  const box = $("student-box"), text = box.value;
  busy = true;
  try {
    const r = await fetch(url("/api/room/chat"), { method: "POST",
      headers: { "Content-Type": "application/json", "X-Room-Token": me.token }, body: JSON.stringify({ text }) });
    if (!r.ok) {
      let body = null;
      try { body = await r.json(); } catch (e) { /* not JSON */ }
      if (r.status === 401) { me = null; save(null); }
      showError("chat-error", t("room.failed") + ": " + errorText({ body, status: r.status }));
      return;
    }
    box.value = "";
    bubble("me", text);
    const reply = bubble("bot", "…");
    let got = "", rest = "";
    const reader = r.body.getReader(), dec = new TextDecoder();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      rest += dec.decode(value, { stream: true });
      const lines = rest.split("\n");
      rest = lines.pop();
      for (const line of lines) {
        if (!line) continue;
        const m = JSON.parse(line);
        if (m.rid) { mine.add(m.rid); redrawChart(); }
        if (m.text) { got += m.text; reply.textContent = got; }
        if (m.error) reply.textContent = got + (got ? "\n\n" : "") + "⚠ " + m.error;
        if (m.done && !got) reply.textContent = "";
      }
    }
  } catch (e) {
    showError("chat-error", t("room.failed") + ": " + e.message);
  } finally {
    busy = false;
  }
}

async function initStudent() {
  $("join").addEventListener("click", join);
  $("leave").addEventListener("click", leave);
  $("student-name").addEventListener("keydown", (e) => { if (e.key === "Enter") join(); });
  $("student-form").addEventListener("submit", send);
  $("student-box").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("lang").addEventListener("click", () => setLang(lang() === "zh" ? "en" : "zh"));
  const old = saved();
  if (old && old.token) {
    const res = await getJSON("/api/room/me", { headers: { "X-Room-Token": old.token } });
    if (res.ok) {
      res.body.rids.forEach((rid) => mine.add(rid));
      setMe({ token: old.token, label: res.body.label });
      return;
    }
    save(null);                    // the server restarted: join again
  }
  const res = await getJSON("/api/room/suggest");
  if (res.ok && !$("student-name").value) $("student-name").value = res.body.name;
}

export function initRoom(stage) {
  root = stage;
  if (state.role === "projector") {
    // the chart takes what the rest of the page leaves it, at most 27% of the screen's height: the metrics
    // table grows a line for each later lesson in view (prefix hits, preemptions, hand-overs, drafts), and the
    // page still fits a 1366x768 projector without scrolling. The room it is given does not depend on its own
    // height (that height plus what is spare), so refitting after it resizes changes nothing.
    const fit = () => {
      state.chartScale = projectorScale();
      const H = window.innerHeight, gantt = document.querySelector("[data-testid=gantt]");
      const body = document.body, bottom = body.getBoundingClientRect().bottom + window.scrollY +
        parseFloat(getComputedStyle(body).marginBottom || "0");
      const room = gantt ? gantt.getBoundingClientRect().height + H - bottom - 2 : H * 0.27;
      const maxH = Math.round(Math.max(H * 0.15, Math.min(H * 0.27, room)));
      if (maxH !== state.chartMaxH) { state.chartMaxH = maxH; redrawChart(); }
    };
    fit();
    window.addEventListener("resize", fit);
    new ResizeObserver(fit).observe(document.body);
  } else if (state.role === "student") {
    state.chartMaxH = 560;
    initStudent();
  }
  askRoom();
}
