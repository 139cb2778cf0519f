// Engine controls: policy, the chunked-prefill switch, budgets, the chunk cap, slow motion.
// They write /api/engine and follow the settings in force from the policy events on
// the socket; when the server has a presenter key, writes carry it in X-Presenter-Key
// (kept in this tab's sessionStorage only).
import { onLang, t } from "./i18n.js";
import { onStore, url } from "./socket.js";

let root, state = {}, locked = false, busy = false, polling = null;

const $ = (id) => root.querySelector("[data-testid=" + id + "]");

function key() {
  try { return sessionStorage.getItem("batchscope.key") || ""; } catch (e) { return ""; }
}

function status(text, bad) {
  const el = $("ctl-status");
  el.textContent = text;
  el.dataset.bad = bad ? "1" : "";
}

function render() {
  const p = state.policy;
  root.querySelectorAll("[data-testid=policy] button").forEach((b) => {
    const on = b.dataset.policy === p;
    b.setAttribute("aria-checked", on ? "true" : "false");
    b.classList.toggle("bs-on", on);
  });
  const sw = $("chunked-toggle"), on = p === "chunked";
  sw.setAttribute("aria-checked", on ? "true" : "false");
  sw.classList.toggle("bs-on", on);
  $("chunked-state").textContent = t(on ? "ctl.on" : "ctl.off");
  renderPair();
  for (const input of root.querySelectorAll("input[data-setting]")) {
    const name = input.dataset.setting, v = state[name];
    if (document.activeElement === input || v === undefined) continue;
    input.value = v == null ? "" : v;         // the chunk cap: empty means no cap
  }
  const d = $("step-delay");
  if (state.step_delay != null && document.activeElement !== d) {
    d.value = Math.round(state.step_delay * 1000);
    $("step-delay-value").textContent = d.value;
  }
  const shut = locked && !key();          // inactive until the presenter key is entered (a press says so)
  root.querySelector(".bs-controls").classList.toggle("bs-locked", shut);
  root.querySelectorAll("button, input[data-setting], input[type=range]").forEach((e) => {
    if (shut) e.setAttribute("aria-disabled", "true"); else e.removeAttribute("aria-disabled");
  });
  $("key-box").hidden = !state.presenter_key_required;
  // an attached vLLM server fixes its settings at start: shown with the values in force, not editable
  const fixed = !!state.read_only;
  root.querySelectorAll("button, input:not([data-testid=presenter-key])").forEach((e) => { e.disabled = fixed; });
  $("chunk-cap-clear").disabled = fixed || state.max_prefill_chunk == null;   // nothing to clear
  root.querySelector(".bs-controls").classList.toggle("bs-readonly", fixed);
  if (fixed) status(t("ctl.read_only") + " " + state.read_only, false);
}

// the prefill/decode pair: `disaggregated` in /api/engine is null (never chosen), "starting" (loading
// two model copies; requests still go to the one engine), "ready" or "failed: <why>"
function renderPair() {
  const pair = state.disaggregated || "", starting = pair === "starting" && state.policy !== "disaggregated";
  const note = $("disagg-note"), key = starting ? "ctl.disagg_starting" : "ctl.disagg_note";
  note.hidden = !(starting || state.policy === "disaggregated");
  note.dataset.i18n = key; note.textContent = t(key);
  root.querySelector("[data-policy=disaggregated]").classList.toggle("bs-pending", starting);
  if (pair.startsWith("failed")) status(t("ctl.failed") + ": " + pair, true);
  if (starting && !polling) polling = setTimeout(() => { polling = null; load(); }, 2000);   // until ready or failed
}

let absorbed = 0;       // settings taken in so far: an answer asked for before the latest one is stale

function absorb(obj) {
  if (!obj || typeof obj !== "object") return;
  absorbed++;
  const s = obj.settings || obj.engine || obj;
  for (const k of ["policy", "max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk", "step_delay"]) {
    if (s[k] !== undefined) state[k] = s[k];
    else if (obj[k] !== undefined) state[k] = obj[k];
  }
  if (obj.disaggregated !== undefined) state.disaggregated = obj.disaggregated;
  if (obj.read_only !== undefined) state.read_only = obj.read_only;
  if (state.policy === "disaggregated") state.disaggregated = "ready";    // a policy event: the pair is in force
  const server = obj.server || {};
  if (server.presenter_key_required !== undefined) state.presenter_key_required = server.presenter_key_required;
  locked = !!state.presenter_key_required;
  render();
}

async function load() {
  const before = absorbed;
  try {
    const r = await fetch(url("/api/engine"), { cache: "no-store" });
    if (!r.ok) return;
    const body = await r.json();
    // settings that arrived meanwhile (a change's answer, a policy event) are newer than this answer: ask again
    if (absorbed !== before) return load();
    absorb(body);
  } catch (e) { /* offline: the socket's reconnect message says so */ }
}

// POST a change; the view updates from the answer (the engine's real settings)
export async function apply(change) {
  if (busy) return false;
  busy = true;
  try {
    const headers = { "Content-Type": "application/json" };
    if (key()) headers["X-Presenter-Key"] = key();
    const r = await fetch(url("/api/engine"), { method: "POST", headers, body: JSON.stringify(change) });
    let body = null;
    try { body = await r.json(); } catch (e) { /* not JSON */ }
    if (!r.ok) {
      if (r.status === 401 || r.status === 403) { state.presenter_key_required = true; locked = true; status(t("ctl.locked"), true); }
      else status(t("ctl.failed") + ": " + errorText(body, r.status), true);
      render();
      return false;
    }
    absorb(body);
    status(t("ctl.saved"), false);
    return true;
  } catch (e) {
    status(t("ctl.failed") + ": " + e.message, true);
    return false;
  } finally {
    busy = false;
  }
}

function errorText(body, code) {
  if (!body) return "HTTP " + code;
  const d = body.detail || body.error || body.message || body;
  return typeof d === "string" ? d : d.message || JSON.stringify(d);
}

export function initControls(el) {
  root = el;
  root.querySelectorAll("[data-testid=policy] button").forEach((b) =>
    b.addEventListener("click", () => apply({ policy: b.dataset.policy })));
  $("chunked-toggle").addEventListener("click", () =>
    apply({ policy: state.policy === "chunked" ? "continuous" : "chunked" }));
  for (const input of root.querySelectorAll("input[data-setting]")) {
    input.addEventListener("change", () => {
      if (input.dataset.setting === "max_prefill_chunk" && input.value.trim() === "") {
        apply({ max_prefill_chunk: null });
        return;
      }
      const v = parseInt(input.value, 10);
      if (!(v >= 1)) { status(t("ctl.failed") + ": " + input.value, true); render(); return; }
      apply({ [input.dataset.setting]: v });
    });
  }
  $("chunk-cap-clear").addEventListener("click", () => apply({ max_prefill_chunk: null }));
  const d = $("step-delay");
  d.addEventListener("input", () => { $("step-delay-value").textContent = d.value; });
  d.addEventListener("change", () => apply({ step_delay: +d.value / 1000 }));
  const k = $("presenter-key");
  k.value = key();
  k.addEventListener("change", () => {
    try { sessionStorage.setItem("batchscope.key", k.value); } catch (e) { /* private mode */ }
    status("", false);
    render();
  });
  // settings changed by anyone (another presenter, a scenario) arrive as policy events
  onStore((store) => {
    if (store.settings && store.settings.policy && store.settings !== state._seen) {
      state._seen = store.settings;
      absorb(store.settings);
    }
  });
  onLang(render);
  load();               // once, for what only /api/engine says (is a presenter key needed); then the socket
}
