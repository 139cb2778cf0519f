// The lecturer's lesson strip: captions folded to one line (a click opens one), and the pressed
// lesson's caption shown above the chart, the page scrolled so that caption, chart and batch bar
// share one screen (a projector at 1366x768 included: the chart grows only as far as that allows).
// On the other pages (projector, students', a replayed trace), the lesson playing is named over the
// chart, from the record stream's lesson messages.
import { toggleLesson } from "./a11y.js";
import { fmt, lang, onLang, t } from "./i18n.js";
import { onStore, store } from "./socket.js";
import { state } from "./state.js";


function caption() { return document.querySelector("[data-testid=lesson-caption]"); }

// the Gantt's tallest height that keeps the caption and the whole batch bar on screen with it
export function fitChart() {
  const cap = caption(), gantt = document.querySelector("[data-testid=gantt]"),
    bar = document.querySelector("[data-testid=batch-bar]");
  if (state.role !== "lecturer" || !cap || !gantt || !bar) return;
  const top = (cap.hidden ? gantt.closest(".bs-chart") : cap).getBoundingClientRect().top;
  const g = gantt.getBoundingClientRect(), b = bar.getBoundingClientRect();
  const around = (g.top - top) + (b.bottom - g.bottom) + 16;
  state.chartMaxH = Math.max(194, Math.min(420, Math.floor(window.innerHeight - around)));
}

// The caption follows what it shows: the lesson's text in the strip, which Gradio redraws in the other
// language when it is switched; and a lesson stopped by one pressed in another tab, which the server marks
// on this tab's hidden list of its requests with the lesson's number (app/ui/page.py mine_html,
// data-stopped): the caption then says why instead of naming a lesson no longer playing.
function syncCaption() {
  const cap = caption(), mine = document.querySelector("[data-mine]");
  if (!cap || cap.hidden) return;
  const text = mine && mine.dataset.stopped === cap.dataset.lesson ? t("page.lesson_stopped")
    : lessonText(cap.dataset.lesson);
  if (text && cap.textContent !== text) cap.textContent = text;
}

// lesson k's text in the strip, on one line ("" where the page has none)
function lessonText(k) {
  const src = document.getElementById("bs-lesson-text-" + k);
  return src ? src.textContent.replace(/\s+/g, " ").trim() : "";
}

let watching = false;
function watchCaption() {
  const boxes = [document.querySelector(".bs-mine"), ...document.querySelectorAll("[id^=bs-lesson-text-]")];
  if (watching || !boxes[0]) return;
  const seen = new MutationObserver(syncCaption);
  const what = { subtree: true, childList: true, characterData: true, attributes: true };
  for (const box of boxes) seen.observe(box, what);
  watching = true;
}

export function showLesson(k) {
  const cap = caption();
  if (!cap) return;
  cap.textContent = lessonText(k);
  cap.dataset.lesson = String(k);
  watchCaption();
  const steps = store.steps;            // where this lesson's steps begin (the what-if panel replays from it)
  state.lessonStart = steps.length ? steps[steps.length - 1].step + 1 : 0;
  cap.hidden = !cap.textContent;
  drawLessonNow();
  fitChart();
  cap.scrollIntoView({ block: "start" });
}

// "1 · Static batching.": the bold lead of the lesson's words, their first sentence where they have none
export function lessonTitle(m) {
  const words = fmt("page." + m.text, { k: m.lesson });
  const bold = /\*\*(.+?)\*\*/.exec(words);
  return (bold ? bold[1] : words.split(/(?<=[.。])\s/)[0]).replace(/[*_]/g, "").trim();
}

// the lesson over the chart: "Now playing" while it plays, "Just played" once it ended (the chart still
// shows its steps), nothing once it was stopped. A lecturer's tab that pressed a lesson has its caption
// instead, which says more.
let lessonDrawn = "";        // what drawLessonNow last drew from: the store calls it on every new record
function drawLessonNow() {
  const el = document.querySelector("[data-testid=lesson-now]"), m = store.lesson, cap = caption();
  const own = !!(cap && !cap.hidden);
  const key = m ? [m.event, m.lesson, m.text, lang(), own].join("|") : "";
  if (!el || key === lessonDrawn) return;
  lessonDrawn = key;
  const text = m && m.event !== "stopped" && !own
    ? fmt(m.event === "ended" ? "lesson.ended" : "lesson.now", { title: lessonTitle(m) }) : "";
  el.textContent = text;
  el.hidden = !text;
  el.dataset.event = m ? m.event : "";
}
onStore(drawLessonNow);
onLang(drawLessonNow);

document.addEventListener("click", (e) => {
  const text = e.target.closest && e.target.closest("[id^=bs-lesson-text-]");
  if (text) toggleLesson(text);
});
window.addEventListener("resize", () => fitChart());
