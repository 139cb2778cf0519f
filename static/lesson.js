// The lecturer's lesson strip: captions folded to one line (a click opens one), and the pressed
// lesson's caption shown above the chart, the page scrolled so that caption, chart and batch bar
// share one screen (a projector at 1366x768 included: the chart grows only as far as that allows).
import { toggleLesson } from "./a11y.js";
import { store } from "./socket.js";
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

export function showLesson(k) {
  const src = document.getElementById("bs-lesson-text-" + k), cap = caption();
  if (!cap) return;
  cap.textContent = src ? src.textContent.replace(/\s+/g, " ").trim() : "";
  cap.dataset.lesson = String(k);
  const steps = store.steps;            // where this lesson's steps begin (the what-if panel replays from it)
  state.lessonStart = steps.length ? steps[steps.length - 1].step + 1 : 0;
  cap.hidden = !cap.textContent;
  fitChart();
  cap.scrollIntoView({ block: "start" });
}

document.addEventListener("click", (e) => {
  const text = e.target.closest && e.target.closest("[id^=bs-lesson-text-]");
  if (text) toggleLesson(text);
});
window.addEventListener("resize", () => fitChart());
