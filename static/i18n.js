// Looking words up: the strings live in one table per language (strings/en.js, strings/zh.js, the Gradio
// page's too); this file only picks the language, looks keys up and fills {placeholders}.
// Elements carry data-i18n="key"; setLang() rewrites their textContent (never innerHTML).
import en from "./strings/en.js";
import zh from "./strings/zh.js";

const TABLES = { en, zh };
let current = "en";
const listeners = [];

// the word for `key` in the current language (English if that language lacks it, the key if both do)
export function t(key) {
  return TABLES[current][key] ?? en[key] ?? key;
}

// t(key) with each {name} replaced by vars[name]: fmt("why.by", { by: "Alice", n: 12 })
export function fmt(key, vars) {
  return t(key).replace(/\{(\w+)\}/g, (_, k) => vars[k]);
}

export const lang = () => current;

export function applyLang(root) {
  (root || document).querySelectorAll("[data-i18n]").forEach((el) => {
    el.textContent = t(el.getAttribute("data-i18n"));
  });
  (root || document).querySelectorAll("[data-i18n-label]").forEach((el) => {
    el.setAttribute("aria-label", t(el.getAttribute("data-i18n-label")));
  });
  (root || document).querySelectorAll("[data-i18n-placeholder]").forEach((el) => {
    el.placeholder = t(el.getAttribute("data-i18n-placeholder"));
  });
}

export function setLang(next) {
  current = TABLES[next] ? next : "en";
  applyLang();
  listeners.forEach((fn) => fn(current));
  return current;
}

export const onLang = (fn) => listeners.push(fn);
