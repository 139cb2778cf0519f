"""The page's words: one table per language (static/strings/en.js, zh.js), read by the browser modules
and by app/ui/text.py. Both languages have the same keys and the same {placeholders}; every key is used;
no script outside the tables holds a word a student reads."""
import re
from pathlib import Path

from app.replay.scenarios import LESSONS
from app.ui.text import STRINGS, load_strings

ROOT = Path(__file__).resolve().parent.parent
STATIC = ROOT / "static"
SCRIPTS = sorted(STATIC.glob("*.js"))
PLACEHOLDER = re.compile(r"\{(\w+)(?:[:!][^}]*)?\}")          # {name}, and Python's {n:,}
LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|`(?:\\.|[^`\\])*`')
CJK = re.compile(r"[\u3000-\u9fff\uff00-\uffef]")
# a word as prose has it: not a key (a.b), a class (bs-x), a path or a query (api/x?y=z), a size (11px)
WORD = re.compile(r"(?<![\w./=?:-])[A-Za-z]{2,}(?![\w./=?-])")


def test_both_languages_have_the_same_keys_and_placeholders():
    en, zh = STRINGS["en"], STRINGS["zh"]
    assert set(en) == set(zh) and len(en) > 200
    for key in en:
        assert set(PLACEHOLDER.findall(en[key])) == set(PLACEHOLDER.findall(zh[key])), key
        assert en[key].strip() and zh[key].strip(), key


def test_the_tables_are_json_behind_one_export():
    for lang in ("en", "zh"):
        src = (STATIC / "strings" / f"{lang}.js").read_text(encoding="utf-8")
        code = [line for line in src.splitlines() if line and not line.startswith("//")]
        assert code[0] == "export default {" and code[-1] == "};", lang
        assert load_strings(lang) == STRINGS[lang]


def code_of(src: str) -> str:
    """JS without its comments (whole-line and trailing `// ...`)."""
    src = re.sub(r"^\s*//.*$", "", src, flags=re.M)
    return re.sub(r"\s//\s.*$", "", src, flags=re.M)


def prose(text: str) -> bool:
    """A literal a student would read: Chinese, or two English words (template holes aside)."""
    text = re.sub(r"\$\{[^}]*\}", " ", text)
    return bool(CJK.search(text)) or len(WORD.findall(text)) >= 2


def test_no_script_outside_the_tables_holds_words():
    for path in SCRIPTS:
        code = re.sub(r"new Error\((?:\"[^\"]*\"|'[^']*')\)", "", code_of(path.read_text()))   # for developers
        words = [lit for lit in LITERAL.findall(code) if prose(lit[1:-1]) and "[data-" not in lit]
        assert words == [], (path.name, words)
    assert prose('"longest stall"') and prose("最长停顿") and prose("`${n} requests so far`")
    assert not prose("metrics.empty") and not prose("bold 11px sans-serif") and not prose("/api/whatif?format=json")


def test_every_key_is_used():
    js = "".join(code_of(p.read_text()) for p in SCRIPTS)
    html = "".join(p.read_text() for p in STATIC.glob("*.html"))
    py = "".join(p.read_text() for p in (ROOT / "app" / "ui").glob("*.py"))
    prefixes = set(re.findall(r'"([\w.]+\.)" \+', js))     # t("cause." + cause): every cause.* key may be asked for
    for key in STRINGS["en"]:
        if key.startswith("page."):            # the Gradio page's words, looked up in app/ui by their short name
            name = key[len("page."):]
            lesson_texts = {x.text for x in LESSONS if x.text}          # a lesson's own caption and button
            assert (f'"{name}"' in py or re.fullmatch(r"step\d_btn|step\d|short\.\d|set\.\w+", name)
                    or name.removesuffix("_btn") in lesson_texts), key
        elif key.startswith("scenario."):      # a button per scenario: tests/test_ui.py checks the names
            continue
        else:
            used = (f'"{key}"' in js or f'data-i18n="{key}"' in html + py or f'data-i18n-placeholder="{key}"' in html
                    or f'data-i18n-label="{key}"' in html
                    or any(key.startswith(p) for p in prefixes))
            assert used, key
