"""Words of the Gradio side of the UI, in English and Chinese, and the panel users.

The chart's own strings live in static/i18n.js; the users' names and colours
must match static/palette.js (a test checks that they do).
"""
from __future__ import annotations

# (name, Okabe-Ito colour): one per chat panel, in panel order
USERS = [("Alice", "#E69F00"), ("Bob", "#56B4E9"), ("Carol", "#009E73"), ("Dan", "#CC79A7"),
         ("Eve", "#0072B2"), ("Frank", "#D55E00"), ("Grace", "#F0E442"), ("Heidi", "#7F7F7F")]

LANGS = {"English": "en", "中文": "zh"}

# short preset questions, one per panel, so that "send to all" looks like a class
SHORT = {
    "en": ["What is a GPU, in two sentences?", "Write a haiku about rain.", "Name three prime numbers.",
           "Why is the sky blue?", "Give one tip for learning to cook.", "How do bees find their hive?",
           "What is the capital of France?", "Explain what a recipe is to a child."],
    "zh": ["用两句话解释什么是 GPU。", "写一首关于雨的俳句。", "说出三个质数。", "天空为什么是蓝色的？",
           "给一个学做饭的建议。", "蜜蜂怎么找到蜂巢？", "法国的首都是哪里？", "向孩子解释什么是菜谱。"],
}
SUMMARY_ASK = {"en": "Summarise the following document in three sentences.",
               "zh": "用三句话总结下面这篇文章。"}

TEXT = {
    "en": {
        "title": "## batchscope: watch an LLM engine batch requests, step by step",
        "subtitle": ("Each chat panel below is one user. Send messages from several panels at once and watch "
                     "the chart: every column is one forward pass of the model, shared by everyone in it."),
        "lang": "Language",
        "steps_title": "### Three generations of batching, the budget that shapes a step, and a fourth generation that stops sharing: press a button, then watch the chart",
        "step1": ("**1 · Static batching.** A batch is formed, prefilled together, then decoded until its "
                  "*longest* reply is done. Nobody joins mid-batch: short replies finish and their slots sit "
                  "idle, while newcomers wait (dashed *queued* lines)."),
        "step1_btn": "▶ 1 · Run: 8 requests, 4 slots (static)",
        "step2": ("**2 · Continuous batching.** The scheduler decides again at every step: a finished request "
                  "leaves, a waiting one joins at once. But a new prompt is prefilled *whole, in one step*, and "
                  "everyone else sits that step out: a long document freezes all replies (the cross-hatched "
                  "**stall**)."),
        "step2_btn": "▶ 2 · Run: 3 chats, then a long document (continuous)",
        "step3": ("**3 · Chunked prefill.** Decode first: every running reply gets its next token, and the "
                  "leftover token budget takes a *chunk* of the new prompt. The document is read over several "
                  "steps that still carry everyone's token, so the stall is gone. Flip the **Chunked prefill** "
                  "switch to compare."),
        "step3_btn": "▶ 3 · Run: the same, with chunked prefill",
        "step4": ("**4 · The token budget.** A step computes at most *budget* tokens, however they are split. "
                  "At a budget of 16 (prefill chunks of at most 4): 8 replies decode while two new prompts are "
                  "read in chunks of 4 (8 + 2 × 4), then 16 replies decode at once (16 × 1), then four new "
                  "4-token prompts fill a step with prefill alone (4 × 4). The batch bar under the chart draws "
                  "one slot per token: watch the same 16 slots take three shapes."),
        "step4_btn": "▶ 4 · Run: a budget of 16 tokens, three shapes (chunked)",
        "step5": ("**5 · Disaggregated prefill and decode.** Stop sharing: a *prefill worker* reads prompts and a "
                  "*decode worker* writes replies, two processes side by side, so the chart gets one lane each. "
                  "When a prompt is read, its KV blocks are handed over (the black arrow: blocks, bytes, time). "
                  "This runs the long document twice, chunked then disaggregated. Chunked keeps one pool and slows "
                  "everyone a little per chunk; disaggregated never lets a prompt touch a decode step, at the price "
                  "of a KV transfer and of splitting the machine in two: the lane headers show each worker's "
                  "threads (on a 2-core CPU, one core each), and both load a copy of the model."),
        "step5_btn": "▶ 5 · Run: the long document, chunked then disaggregated",
        "scenarios": "More scenarios (run under the current settings):",
        "add": "+ Add a user", "remove": "− Remove a user", "clear": "Clear chats", "stop": "■ Stop all",
        "send": "Send", "short": "Short question", "long": "Long document (~1,500 tokens)",
        "all": "Send to all", "placeholder": "Type a message for {name}...",
        "locked": "Settings are locked (presenter key), so this ran under the current policy.",
        "pair_starting": ("Switching to disaggregated: waiting for the prefill and decode workers (two processes, "
                          "a model copy each; the first time takes a while)…"),
        "pair_failed": "The prefill and decode workers did not start ({why}), so the disaggregated run was left out.",
        "err_empty": "The message is empty: type something first.",
        "err_chars": "That message is too long ({n:,} characters; the limit is {limit:,}).",
        "err_long": "That message is too long for the model: {msg}",
        "err_busy": "The engine is busy: {msg}",
        "err_down": "The engine is not available right now: {msg}",
        "err_reply": "The reply stopped early: {msg}",
        "doc_shown": "📄 {ask} (a {tokens}-token document: the history of a lighthouse)",
        "lesson_setting": "*Runs under:* {setting}",
        "in_force": "Settings in force: {setting}",
        "set.policy": "{policy}", "set.budget": "budget {n} tokens", "set.seqs": "at most {n} sequences",
        "set.chunk": "prefill chunks of at most {n} tokens", "set.no_chunk": "no chunk cap",
        "set.delay": "{ms} ms pause per step", "set.no_delay": "no slow motion", "set.then": "; then ",
    },
    "zh": {
        "title": "## batchscope：一步一步看 LLM 引擎如何批处理请求",
        "subtitle": "下面每个聊天面板是一个用户。同时从几个面板发消息，然后看图：每一列是模型的一次前向计算，由其中所有人共享。",
        "lang": "语言",
        "steps_title": "### 批处理的三代、决定每一步形状的预算，以及不再共享的第四代：按下按钮，然后看图",
        "step1": ("**1 · 静态批处理。** 先组成一批，一起预填充，然后一起解码，直到其中*最长*的回复结束。"
                  "中途谁也加不进来：短回复早早结束，它的位置空着，新来的请求只能排队（虚线表示*排队*）。"),
        "step1_btn": "▶ 1 · 运行：8 个请求，4 个位置（静态）",
        "step2": ("**2 · 连续批处理。** 调度器每一步都重新决定：结束的请求离开，等待的请求马上加入。"
                  "但新的提示词要在*一步之内整个*预填充，其他人这一步只能等：一篇长文会让所有回复卡住"
                  "（交叉线格子就是**停顿**）。"),
        "step2_btn": "▶ 2 · 运行：3 个聊天，然后来了一篇长文（连续）",
        "step3": ("**3 · 分块预填充。** 解码优先：每个进行中的回复先拿到下一个 token，剩下的 token 预算再装入新提示词的"
                  "*一块*。长文分几步读完，每一步仍然带着所有人的 token，停顿就消失了。拨动**分块预填充**开关来对比。"),
        "step3_btn": "▶ 3 · 运行：同样的场景，打开分块预填充",
        "step4": ("**4 · token 预算。** 一步最多计算*预算*个 token，不管怎么分。预算为 16（每块预填充最多 4 个 token）时："
                  "先是 8 个回复解码，同时两个新提示词每次读 4 个 token（8 + 2 × 4）；然后 16 个回复一起解码（16 × 1）；"
                  "最后四个 4-token 的新提示词只用预填充就占满一步（4 × 4）。图下方的批次条每个 token 画一格："
                  "看同样的 16 格变成三种形状。"),
        "step4_btn": "▶ 4 · 运行：16 个 token 的预算，三种形状（分块）",
        "step5": ("**5 · 预填充与解码分离。** 不再共享：*预填充 worker* 读提示词，*解码 worker* 写回复，两个进程同时运行，"
                  "所以图上每个 worker 一条泳道。提示词读完后，它的 KV 块交给解码 worker（黑色箭头：块数、字节、耗时）。"
                  "这里把长文场景跑两遍：先分块，再分离。分块只有一个 KV 池，每一块都让所有人慢一点；分离式从不让提示词进入"
                  "解码步，代价是一次 KV 传输，以及把机器一分为二：泳道标题显示每个 worker 的线程数（2 核 CPU 上各一个核），"
                  "而且两个 worker 各加载一份模型。"),
        "step5_btn": "▶ 5 · 运行：长文，先分块再分离",
        "scenarios": "更多场景（按当前设置运行）：",
        "add": "+ 添加用户", "remove": "− 移除用户", "clear": "清空聊天", "stop": "■ 全部停止",
        "send": "发送", "short": "短问题", "long": "长文（约 1500 token）",
        "all": "发给所有人", "placeholder": "给 {name} 输入消息……",
        "locked": "设置已锁定（演示者密钥），所以按当前策略运行。",
        "pair_starting": "切换到分离式：等待预填充和解码 worker 启动（两个进程，各一份模型；第一次需要一些时间）……",
        "pair_failed": "预填充和解码 worker 没有启动（{why}），所以没有运行分离式这一遍。",
        "err_empty": "消息是空的：请先输入内容。",
        "err_chars": "消息太长（{n:,} 个字符；上限是 {limit:,}）。",
        "err_long": "消息对模型来说太长：{msg}",
        "err_busy": "引擎正忙：{msg}",
        "err_down": "引擎暂时不可用：{msg}",
        "err_reply": "回复提前停止：{msg}",
        "doc_shown": "📄 {ask}（一篇 {tokens} token 的文章：一座灯塔的历史）",
        "lesson_setting": "*运行设置：* {setting}",
        "in_force": "当前设置：{setting}",
        "set.policy": "{policy}", "set.budget": "预算 {n} 个 token", "set.seqs": "最多 {n} 个序列",
        "set.chunk": "每块预填充最多 {n} 个 token", "set.no_chunk": "不限块大小",
        "set.delay": "每步暂停 {ms} ms", "set.no_delay": "不慢放", "set.then": "；然后 ",
    },
}

# scenario buttons: app/replay/scenarios.py name -> button text
SCENARIO_BUTTONS = {
    "en": {"long-prompt-interrupts": "3 chats + a long document", "static-vs-continuous": "8 requests, 4 slots",
           "bursty": "a burst of 24 requests", "shared-system-prompt": "shared system prompt (prefix cache)",
           "budget-shapes": "budget 16: three shapes", "split-prefill-decode": "a long document (for disaggregated)"},
    "zh": {"long-prompt-interrupts": "3 个聊天 + 一篇长文", "static-vs-continuous": "8 个请求，4 个位置",
           "bursty": "24 个请求突然涌入", "shared-system-prompt": "共享系统提示词（前缀缓存）",
           "budget-shapes": "预算 16：三种形状", "split-prefill-decode": "一篇长文（用于分离式）"},
}


POLICY_NAMES = {"zh": {"static": "静态", "continuous": "连续", "chunked": "分块", "disaggregated": "分离式"}}


def setting_line(lang: str, setting: dict) -> str:
    """One line for a full setting (app/replay/scenarios.py SETTING_KEYS): what a lesson runs under."""
    policy = setting["policy"]
    chunk, delay = setting.get("max_prefill_chunk"), setting.get("step_delay") or 0
    parts = [t(lang, "set.policy", policy=POLICY_NAMES.get(lang, {}).get(policy, policy)),
             t(lang, "set.budget", n=setting["max_num_batched_tokens"]),
             t(lang, "set.seqs", n=setting["max_num_seqs"]),
             t(lang, "set.chunk", n=chunk) if chunk else t(lang, "set.no_chunk"),
             t(lang, "set.delay", ms=round(delay * 1000)) if delay else t(lang, "set.no_delay")]
    return " · ".join(parts)


def t(lang: str, key: str, **fmt) -> str:
    s = TEXT.get(lang, TEXT["en"]).get(key) or TEXT["en"][key]
    return s.format(**fmt) if fmt else s
