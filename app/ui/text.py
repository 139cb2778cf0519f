"""Words of the Gradio side of the UI, in English and Chinese, and the panel users.

The words live in the page's one table per language, static/strings/en.js and zh.js (the browser
imports them; their body is JSON, read here): the Gradio page's under "page.", the scenario buttons
under "scenario.", the policy names under "policy." shared with the chart. The users' names and
colours must match static/palette.js (a test checks that they do).
"""
from __future__ import annotations

import json
from pathlib import Path

# (name, Okabe-Ito colour): one per chat panel, in panel order
USERS = [("Alice", "#E69F00"), ("Bob", "#56B4E9"), ("Carol", "#009E73"), ("Dan", "#CC79A7"),
         ("Eve", "#0072B2"), ("Frank", "#D55E00"), ("Grace", "#F0E442"), ("Heidi", "#7F7F7F")]

# each language named so that it reads without a CJK font (the Latin part) and in its own script
LANGS = {"English": "en", "Chinese (中文)": "zh"}
STRINGS_DIR = Path(__file__).resolve().parent.parent.parent / "static" / "strings"


def load_strings(lang: str) -> dict[str, str]:
    """static/strings/<lang>.js: one `export default {...};` whose object is plain JSON (the page imports it)."""
    src = (STRINGS_DIR / f"{lang}.js").read_text(encoding="utf-8")
    body = src[src.index("export default") + len("export default"):].strip()
    return json.loads(body.removesuffix(";"))


STRINGS = {code: load_strings(code) for code in LANGS.values()}


def _part(prefix: str) -> dict[str, dict[str, str]]:
    """The keys under `prefix` in each language, prefix dropped."""
    return {code: {k[len(prefix):]: v for k, v in table.items() if k.startswith(prefix)}
            for code, table in STRINGS.items()}


# the Gradio page's own words ("page.*"); "page.short.N": a short preset question per panel, so that
# "send to all" looks like a class; "scenario.<name>": app/replay/scenarios.py name -> button text
TEXT = _part("page.")
SHORT = {code: [TEXT[code][f"short.{i}"] for i in range(1, len(USERS) + 1)] for code in STRINGS}
SUMMARY_ASK = {code: TEXT[code]["summary_ask"] for code in STRINGS}
SCENARIO_BUTTONS = _part("scenario.")
POLICY_NAMES = _part("policy.")


def setting_line(lang: str, setting: dict) -> str:
    """One line for a full setting (app/replay/scenarios.py SETTING_KEYS): what a lesson runs under."""
    policy = setting["policy"]
    chunk, delay = setting.get("max_prefill_chunk"), setting.get("step_delay") or 0
    parts = [t(lang, "set.policy", policy=POLICY_NAMES.get(lang, {}).get(policy, policy)),
             t(lang, "set.budget", n=setting["max_num_batched_tokens"]),
             t(lang, "set.seqs", n=setting["max_num_seqs"]),
             t(lang, "set.chunk", n=chunk) if chunk else t(lang, "set.no_chunk"),
             t(lang, "set.cache_on") if setting.get("enable_prefix_caching", True) else t(lang, "set.cache_off"),
             t(lang, "set.kv_cap", n=setting["max_kv_blocks"]) if setting.get("max_kv_blocks")
             else t(lang, "set.kv_all"),
             t(lang, "set.delay", ms=round(delay * 1000)) if delay else t(lang, "set.no_delay")]
    if spec := setting.get("speculative_config"):
        lo, hi = spec.get("prompt_lookup_min") or spec["prompt_lookup_max"], spec["prompt_lookup_max"]
        parts.append(t(lang, "set.spec", k=spec["num_speculative_tokens"], n=f"{lo}–{hi}" if lo != hi else hi))
    elif "speculative_config" in setting:
        parts.append(t(lang, "set.no_spec"))
    return " · ".join(parts)


def t(lang: str, key: str, **fmt) -> str:
    s = TEXT.get(lang, TEXT["en"]).get(key) or TEXT["en"][key]
    return s.format(**fmt) if fmt else s
