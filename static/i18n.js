// Strings of the chart, controls and metrics in English and Chinese.
// Elements carry data-i18n="key"; setLang() rewrites their textContent (never innerHTML).
(function () {
  const BS = (window.BS = window.BS || {});

  const STRINGS = {
    en: {
      "chart.title": "Every forward pass of the engine, live",
      "chart.hint": "One row per request, one column per step (forward pass). Read a column top to bottom: who shared that step.",
      "legend.decode": "decode: 1 new reply token",
      "legend.prefill": "prefill: reading the prompt (tokens)",
      "legend.stall": "stalled: reply under way, left out of this step",
      "legend.queued": "queued: waiting to start",
      "legend.marker": "setting changed",
      "bar.title": "What each step computed: decode tokens, prefill tokens and unused token budget",
      "bar.budget": "budget",
      "bar.unused": "unused",
      "play.pause": "Pause",
      "play.resume": "Live",
      "play.back": "Step back",
      "play.step": "Step",
      "play.replay": "Replay",
      "play.live": "LIVE",
      "play.paused": "PAUSED",
      "play.replaying": "REPLAY",
      "play.at": "step",
      "play.zoom": "steps in view",
      "axis.label": "x axis",
      "axis.step": "step index",
      "axis.time": "wall time",
      "ctl.policy": "Scheduling policy",
      "ctl.chunked": "Chunked prefill",
      "ctl.on": "ON",
      "ctl.off": "OFF",
      "ctl.budget": "Token budget per step",
      "ctl.seqs": "Max sequences per step",
      "ctl.delay": "Slow motion (ms per step)",
      "ctl.apply": "Apply",
      "ctl.key": "Presenter key",
      "ctl.locked": "Locked: enter the presenter key to change settings.",
      "ctl.saved": "Applied.",
      "ctl.failed": "Not applied",
      "policy.static": "static",
      "policy.continuous": "continuous",
      "policy.chunked": "chunked",
      "metrics.title": "Metrics per setting (each column = a stretch of steps under one setting)",
      "metrics.segment": "setting",
      "metrics.steps": "steps",
      "metrics.ttft": "time to first token p50 / p99",
      "metrics.tbt": "time between tokens p50 / p99",
      "metrics.stall": "longest stall",
      "metrics.tps": "output tokens / s",
      "metrics.kv": "KV cache use (peak)",
      "metrics.waiting": "waiting queue (peak)",
      "metrics.empty": "No steps yet: send a message or run a scenario.",
      "conn.live": "connected",
      "conn.lost": "connection lost, reconnecting...",
      "conn.gap": "missed steps (slow connection)",
      "tip.step": "step",
      "tip.req": "request",
      "tip.kind": "kind",
      "tip.tokens": "tokens",
      "tip.pos": "positions",
      "tip.dur": "step took",
      "tip.batch": "batch",
      "tip.stalled": "stalled: no token this step",
      "tip.queued": "queued since",
      "tip.first": "first token this step",
      "tip.cached": "from prefix cache",
      "kind.decode": "decode",
      "kind.prefill": "prefill",
      "spark.gap": "longest gap",
      "marker.on": "chunked prefill ON",
      "marker.off": "chunked prefill OFF",
    },
    zh: {
      "chart.title": "引擎的每一次前向计算（实时）",
      "chart.hint": "每行是一个请求，每列是一步（一次前向计算）。从上往下读一列：这一步里有谁。",
      "legend.decode": "解码：生成 1 个回复 token",
      "legend.prefill": "预填充：读取提示词（token 数）",
      "legend.stall": "停顿：回复进行中，却被这一步落下",
      "legend.queued": "排队：等待开始",
      "legend.marker": "设置变更",
      "bar.title": "每一步算了什么：解码 token、预填充 token 和未用完的 token 预算",
      "bar.budget": "预算",
      "bar.unused": "未用",
      "play.pause": "暂停",
      "play.resume": "实时",
      "play.back": "后退一步",
      "play.step": "前进一步",
      "play.replay": "回放",
      "play.live": "实时",
      "play.paused": "已暂停",
      "play.replaying": "回放中",
      "play.at": "第",
      "play.zoom": "显示的步数",
      "axis.label": "横轴",
      "axis.step": "步序号",
      "axis.time": "真实时间",
      "ctl.policy": "调度策略",
      "ctl.chunked": "分块预填充",
      "ctl.on": "开",
      "ctl.off": "关",
      "ctl.budget": "每步 token 预算",
      "ctl.seqs": "每步最多序列数",
      "ctl.delay": "慢动作（毫秒/步）",
      "ctl.apply": "应用",
      "ctl.key": "演示者密钥",
      "ctl.locked": "已锁定：输入演示者密钥后才能修改设置。",
      "ctl.saved": "已应用。",
      "ctl.failed": "未应用",
      "policy.static": "静态",
      "policy.continuous": "连续",
      "policy.chunked": "分块",
      "metrics.title": "按设置分段的指标（每列 = 同一设置下的一段步）",
      "metrics.segment": "设置",
      "metrics.steps": "步",
      "metrics.ttft": "首 token 延迟 p50 / p99",
      "metrics.tbt": "token 间隔 p50 / p99",
      "metrics.stall": "最长停顿",
      "metrics.tps": "输出 token / 秒",
      "metrics.kv": "KV 缓存占用（峰值）",
      "metrics.waiting": "等待队列（峰值）",
      "metrics.empty": "还没有步：发一条消息或运行一个场景。",
      "conn.live": "已连接",
      "conn.lost": "连接断开，正在重连……",
      "conn.gap": "漏掉了一些步（连接太慢）",
      "tip.step": "步",
      "tip.req": "请求",
      "tip.kind": "类型",
      "tip.tokens": "token 数",
      "tip.pos": "位置",
      "tip.dur": "本步耗时",
      "tip.batch": "本批",
      "tip.stalled": "停顿：本步没有 token",
      "tip.queued": "排队开始于",
      "tip.first": "本步产生首个 token",
      "tip.cached": "来自前缀缓存",
      "kind.decode": "解码",
      "kind.prefill": "预填充",
      "spark.gap": "最长间隔",
      "marker.on": "分块预填充 开",
      "marker.off": "分块预填充 关",
    },
  };

  let lang = "en";
  const listeners = [];

  BS.t = function (key) {
    return (STRINGS[lang] && STRINGS[lang][key]) || STRINGS.en[key] || key;
  };

  BS.lang = () => lang;

  BS.applyLang = function (root) {
    (root || document).querySelectorAll("[data-i18n]").forEach((el) => {
      el.textContent = BS.t(el.getAttribute("data-i18n"));
    });
  };

  BS.setLang = function (next) {
    lang = STRINGS[next] ? next : "en";
    BS.applyLang();
    listeners.forEach((fn) => fn(lang));
    return lang;
  };

  BS.onLang = (fn) => listeners.push(fn);

  // a view file brings its own strings: {en: {...}, zh: {...}}
  BS.addStrings = function (table) {
    for (const l in table) STRINGS[l] = Object.assign(STRINGS[l] || {}, table[l]);
  };
})();
