// The one place the browser reads record fields: step records (s), their items (it),
// the KV state (s.kv), request events (ev) and policy events or settings (p), as
// engine/outputs/records.py defines them (docs/step_record.md). Every view reads records
// through `rec` (imported as R), so a renamed field is fixed here once, and
// tests/test_record_fields.py checks every name read here against the schema
// (it finds them by these parameter names: s, it, ev, p, and sc for a stall cause).

export const rec = {
  type: (s) => s.type,

  // ---- step record ----
  step: (s) => s.step,
  tStart: (s) => s.t_start,
  tEnd: (s) => s.t_end,
  dur: (s) => s.t_end - s.t_start,
  policy: (s) => s.policy,
  budget: (s) => s.token_budget,
  maxSeqs: (s) => s.max_num_seqs,
  items: (s) => s.items || [],
  numTokens: (s) => s.num_tokens,
  stalled: (s) => s.stalled || [],
  waiting: (s) => s.waiting,
  kvUsed: (s) => s.kv.used,
  kvTotal: (s) => s.kv.total,
  kvLimit: (s) => s.kv.limit ?? null,   // the live max_kv_blocks cap, when it is below kv.total
  kvFill: (s) => ((s.kv.limit || s.kv.total) ? s.kv.used / (s.kv.limit || s.kv.total) : 0),   // of the cap, if any
  prefixCaching: (s) => s.prefix_caching !== false,    // left out when on
  chunkCap: (s) => s.max_prefill_chunk ?? null,         // the cap on one prompt's chunk; left out when none
  blockSize: (s) => s.kv.block_size,
  preempted: (s) => s.preempted || [],
  finished: (s) => s.finished || [],
  failed: (s) => !!s.failed,
  device: (s) => s.device || "",
  stallCauses: (s) => s.stall_causes || [],
  kvOps: (s) => s.kv_ops || [],
  kvMap: (s) => s.kv_map || null,
  // disaggregated: the worker that ran this step ("prefill" | "decode"), null for one engine
  worker: (s) => s.worker || null,
  threads: (s) => s.threads ?? null,    // disaggregated: torch threads of that worker (its share of the cores)
  lane: (s) => s.lane ?? null,          // a vLLM server with several data-parallel engines: the engine's rank
  // speculative decoding in force: the most tokens drafted per reply; null when off
  speculative: (s) => s.speculative ?? null,
  // a stretch of steps runs under one setting: policy, token budget, max sequences, speculative tokens,
  // prefix caching, KV cap, chunk cap
  settingKey: (s) => s.policy + "/" + s.token_budget + "/" + s.max_num_seqs + "/" + (s.speculative ?? "") + "/" +
    (s.prefix_caching !== false) + "/" + (s.kv.limit ?? "") + "/" + (s.max_prefill_chunk ?? ""),

  // ---- step item ----
  req: (it) => it.req,
  label: (it) => it.label,
  kind: (it) => it.kind,
  isDecode: (it) => it.kind === "decode",
  tokens: (it) => it.tokens,
  start: (it) => it.start,
  promptLen: (it) => it.prompt_len,
  cached: (it) => it.cached,
  // a prefill item that starts a prompt's read, after any cached prefix (app/readers/metrics.py begins_prompt)
  beginsPrompt: (it) => it.kind === "prefill" && it.start === (it.cached || 0),
  completesPrompt: (it) => !!it.completes_prompt,
  // a decode, or the prefill chunk that finishes the prompt, gives the request a token (app/readers/metrics.py)
  producesToken: (it) => it.kind === "decode" || !!it.completes_prompt,
  // speculative decoding: drafted tokens a decode verified, and of those the ones its reply kept
  drafted: (it) => it.drafted || 0,
  accepted: (it) => it.accepted || 0,
  // output tokens the item gave its reply: a verifying decode 1 + its accepted drafts (metrics.py tokens_given)
  tokensGiven: (it) => (it.kind === "decode" || it.completes_prompt ? 1 + (it.accepted || 0) : 0),

  // ---- stall cause (one entry of a step's stall_causes) ----
  scReq: (sc) => sc.req,
  scCause: (sc) => sc.cause,
  scBy: (sc) => sc.by,
  scByTokens: (sc) => sc.by_tokens,

  // ---- KV map: a block change (op) and a block of a step's whole map (e) ----
  opKind: (op) => op.op,
  opBlock: (op) => op.block,
  opReq: (op) => op.req,
  mapBlock: (e) => e.block,
  mapHolders: (e) => e.holders,
  mapCached: (e) => e.cached,

  // ---- request event ----
  event: (ev) => ev.event,
  evReq: (ev) => ev.req,
  evLabel: (ev) => ev.label,
  evT: (ev) => ev.t,
  evPromptLen: (ev) => ev.prompt_len,
  evMaxTokens: (ev) => ev.max_tokens,
  finishReason: (ev) => ev.finish_reason,
  outputTokens: (ev) => ev.output_tokens,
  abortReason: (ev) => ev.reason,
  // a KV hand-over (event "kv_transfer"): from export start (t - seconds) to import done (t)
  xferBlocks: (ev) => ev.blocks,
  xferBytes: (ev) => ev.bytes,
  xferSeconds: (ev) => ev.seconds,
  xferFrom: (ev) => ev.from_worker,
  xferTo: (ev) => ev.to_worker,
  xferOps: (ev) => ev.kv_ops || [],      // the sending worker's frees of the hand-over (no step of its carries them)

  // ---- policy event, or the settings in a snapshot (the app adds step_delay) ----
  settings(p) {
    const out = {}, all = { policy: p.policy, max_num_batched_tokens: p.max_num_batched_tokens,
      max_num_seqs: p.max_num_seqs, max_prefill_chunk: p.max_prefill_chunk, step_delay: p.step_delay,
      enable_prefix_caching: p.enable_prefix_caching, max_kv_blocks: p.max_kv_blocks };
    for (const k in all) if (all[k] !== undefined) out[k] = all[k];
    return out;
  },
};
