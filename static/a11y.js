// What the Gradio page's own parts need for keyboard and screen-reader users (docs/ui.md: accessibility).
// Gradio renders them after this module runs and may render them again, so a MutationObserver applies
// this to each part as it appears: a lesson's folded text is a disclosure button (Tab to it, Enter or
// Space opens it), and each chat log, a scrolling region, takes the focus and names its user.
import { fmt, onLang } from "./i18n.js";

const LESSON = "[id^=bs-lesson-text-]";

function lessonText(el) {
  if (el.dataset.bsA11y) return;
  el.dataset.bsA11y = "1";
  el.tabIndex = 0;
  el.setAttribute("role", "button");
  el.setAttribute("aria-expanded", String(el.classList.contains("bs-open")));
}

// the chat panel's user is the name in its head (app/ui/page.py panel_head)
function chatLog(log) {
  const panel = log.closest(".bs-panel"), head = panel && panel.querySelector("[data-testid^=panel-head-] span + span");
  const name = head ? head.textContent.trim() : "";
  log.tabIndex = 0;
  const label = fmt("a11y.chat_log", { name });
  if (log.getAttribute("aria-label") !== label) log.setAttribute("aria-label", label);
}

export function applyA11y(root) {
  (root || document).querySelectorAll(LESSON).forEach(lessonText);
  (root || document).querySelectorAll("[id^=bs-chat-] [role=log]").forEach(chatLog);
}

// a lesson text opened or folded, by click or key, says so
export function toggleLesson(el) {
  el.classList.toggle("bs-open");
  el.setAttribute("aria-expanded", String(el.classList.contains("bs-open")));
}

export function initA11y() {
  applyA11y();
  let queued = false;
  new MutationObserver(() => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; applyA11y(); });
  }).observe(document.body, { childList: true, subtree: true });
  document.addEventListener("keydown", (e) => {
    const el = e.target.closest && e.target.closest(LESSON);
    if (!el || e.target !== el || (e.key !== "Enter" && e.key !== " ")) return;
    e.preventDefault();
    toggleLesson(el);
  });
  onLang(() => applyA11y());
}
