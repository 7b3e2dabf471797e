// The studio's JSON API (qcfuse_core/studio/app.py): types and calls. Same origin only.

export interface PromptFrame {
  kind: "chat" | "plain";
  label: string;
  text: string; // the frame with {question} and {document N} placeholders
  stop: string[]; // where answers end besides end-of-text (a base model's)
}

export interface ModelInfo {
  id: string;
  name: string;
  path: string | null;
  source: string; // packaged | option | cache
  architecture: string;
  packaged: string | null;
  default: boolean;
  instruct: boolean | null;
  converted?: boolean | null; // packaged: converted into the cache dir already (else on first use)
  problem?: string;
  layers?: number;
  device?: string;
  dtype?: string;
  fingerprint?: string;
  prompt_frame?: PromptFrame;
}

export interface Status {
  model: ModelInfo;
  loading: Job | null; // a model switch in progress
  store: string;
  chunks: number;
  methods: string[];
  all_methods: string[];
  adaptive_shares: number[]; // the calibrated mean shares of the adaptive mode ([]: not offered)
  memory_kind: string; // what a run's memory number is on this device
  default_ratio: number;
  examples: string[];
  limits: {
    max_upload_bytes: number; max_files: number; max_chunks: number; max_modes: number; suffixes: string[];
    max_repeats: number; max_new_tokens: number;
  };
}

export interface TierStats {
  entries: number;
  bytes_used: number;
  capacity_bytes: number | null; // null: unbounded (the disk tier by default)
  occupancy: number | null;
  hits: number;
  misses: number;
  hit_rate: number | null; // null: nothing looked up yet
  evictions: number;
}

export interface StoreTiers {
  backend: string;
  tiers: Record<string, TierStats>; // fastest first: gpu, host, disk
}

export interface ChunkHit {
  id: string;
  source: string;
  score: number;
  text: string;
  tokens: string[];
  anchors: number[];
  cached: boolean;
}

export interface Stage {
  name: string;
  start_ms: number;
  ms: number;
}

export interface Memory {
  kv_bytes_loaded: number;
  kv_bytes_by_tier: Record<string, number>;
  load_wait_ms: number;
  peak_bytes: number | null; // of this run: device peak (GPU) or resident growth (CPU); null: not measured
  peak_kind: string;
}

export interface Quality {
  kl_first_token: number; // KL(full || mode) of the first token's distribution, nats
  token_match: number; // LCS share of full's greedy answer tokens
  answer_matches: boolean;
  repeats_agree: boolean;
}

export interface Build {
  ms: number;
  built: number;
  cached: number;
}

export interface HistoryRow {
  run_id: string;
  index: number | null; // null: the full-prefill reference of the run
  model: string;
  model_name: string;
  question: string;
  chunks: number;
  max_new_tokens: number;
  method: string;
  ratio: number | null;
  label: string;
  ran_as: string;
  repeats: number;
  ttft_ms: number;
  total_ms: number;
  decode_tok_s: number | null;
  recompute_share: number;
  speedup_vs_full: number | null;
  quality: Quality | null;
  memory: { peak_bytes: number | null; peak_kind: string };
  guard?: Guard | null;
}

export interface Guard {
  signal: string; // first_token_margin: p1 - p2 of the fused first token
  value: number | null;
  threshold: number | null;
  action: string; // kept | ratio R | full | off
  code: string; // low_margin | ceiling | margin_ok | off | not_guarded | uncalibrated
  reason?: string;
}

export interface Agreement {
  same_text: boolean;
  first_token_same: boolean;
  common_prefix_tokens: number;
  full_tokens: number;
  share: number;
}

export interface ModeResult {
  index: number;
  method: string;
  ratio: number;
  label: string;
  ran_as: string;
  answer: string;
  ttft_ms: number; // median of the repeats
  total_ms: number; // median end to end
  decode_tok_s: number | null;
  repeats: number;
  ttft_all_ms: number[];
  quality?: Quality;
  stages: Stage[];
  context_tokens: number;
  prompt_tokens: number;
  recomputed_tokens: number;
  recompute_share: number;
  guard?: Guard | null; // the quality guard's signal and action
  answered: string; // what answered and what the guard did, one line (FusionResult.what_answered)
  cache_hits: number;
  cache_misses: number;
  chunks: number;
  new_tokens: number;
  memory: Memory;
  speedup_vs_full?: number | null;
  agreement?: Agreement;
}

export interface RunResponse {
  run_id: string;
  question: string;
  chunk_ids: string[];
  model: string;
  model_name: string;
  repeats: number;
  build: Build;
  results: ModeResult[];
  reference: Reference | null;
  history: HistoryRow[];
}

export interface Reference {
  answer: string;
  ttft_ms: number;
  total_ms?: number;
  decode_tok_s?: number | null;
  repeats?: number;
}

export interface ChunkStat {
  segment: number;
  node_id: string | null;
  tokens: number;
  score_share: number | null;
  recomputed: number;
  recomputed_at_start: number;
  recomputed_filler: number;
  anchors: number;
}

export interface Explanation {
  text: string[];
  start_window: number;
  chunks: ChunkStat[];
  recomputed_chunk_tokens: number;
  recomputed_at_start: number;
  recomputed_filler: number;
  glue_tokens: number;
}

export interface TokenInfo {
  pos: number;
  text: string;
  seg: number;
  depth: number;
  score: number | null;
  anchor: boolean;
}

export interface SegmentInfo {
  index: number;
  kind: string; // chunk | text (glue)
  start: number;
  end: number;
  node_id: string | null;
  cache_hit: boolean;
}

export interface Details extends ModeResult {
  run_id: string;
  num_layers: number;
  critical_layers: number[];
  row_sets: { from_layer: number; to_layer: number; context_rows: number }[];
  score_kind: string | null;
  segments: SegmentInfo[];
  tokens: TokenInfo[];
  recomputed_positions: number[];
  anchor_positions: number[];
  explanation: Explanation;
}

export interface Job {
  id: string;
  kind: string;
  state: "queued" | "running" | "done" | "failed";
  stage: string;
  done: number;
  total: number;
  result: {
    files?: string[]; chunks?: number; chunk_ids?: string[]; sources?: string[]; // ingest
    model_id?: string; name?: string; message?: string; model?: ModelInfo; // model
    stages?: { stage: string; message: string }[]; // model: every stage so far
  } | null;
  error: string | null;
}

export interface Mode {
  method: string;
  ratio: number;
}

export class ApiError extends Error {
  constructor(message: string, readonly status: number) {
    super(message);
  }
}

async function call<T>(path: string, init?: RequestInit): Promise<T> {
  const res = await fetch(path, init);
  const body = await res.json().catch(() => null);
  if (!res.ok) {
    throw new ApiError(body?.error?.message ?? `${res.status} ${res.statusText}`, res.status);
  }
  return body as T;
}

const json = (body: unknown): RequestInit => ({
  method: "POST",
  headers: { "Content-Type": "application/json" },
  body: JSON.stringify(body),
});

export const api = {
  status: () => call<Status>("/api/status"),
  store: () => call<StoreTiers>("/api/store"),
  models: () => call<{ current: string; models: ModelInfo[] }>("/api/models"),
  selectModel: (id: string) => call<Job>("/api/models/select", json({ id })),
  search: (question: string, top_k: number) =>
    call<{ question: string; chunks: ChunkHit[] }>("/api/search", json({ question, top_k })),
  details: (runId: string, index: number) => call<Details>(`/api/runs/${runId}/details/${index}`),
  chunks: (ids: string[]) => call<{ chunks: Omit<ChunkHit, "score">[] }>("/api/chunks", json({ ids })), // no score: no query
  history: () => call<{ rows: HistoryRow[]; kept: number }>("/api/history"),
  clearHistory: () => call<{ rows: HistoryRow[]; kept: number }>("/api/history", { method: "DELETE" }),
  ingest: (files: File[]) => {
    const form = new FormData();
    for (const f of files) form.append("files", f, f.name);
    return call<Job>("/api/ingest", { method: "POST", body: form });
  },
};

export type RunEvent =
  | { event: "build"; data: { state: string; chunks?: number } & Partial<Build> }
  | { event: "repeat"; data: { index: number; k: number; ttft_ms: number } }
  | { event: "mode"; data: { index: number; method: string; ratio: number; label: string; repeats: number } }
  | { event: "delta"; data: { index: number; text: string } }
  | { event: "result"; data: ModeResult }
  | { event: "reference"; data: { state: string } & Partial<Reference> }
  | { event: "done"; data: RunResponse }
  | { event: "error"; data: { message: string; type: string } };

/** POST /api/run/stream and hand each server-sent event to `onEvent` as it arrives. */
export async function streamRun(
  body: { question: string; chunk_ids: string[]; modes: Mode[]; max_new_tokens?: number; repeats?: number },
  onEvent: (ev: RunEvent) => void,
): Promise<void> {
  const res = await fetch("/api/run/stream", json(body));
  if (!res.ok || !res.body) {
    const err = await res.json().catch(() => null);
    throw new ApiError(err?.error?.message ?? `${res.status} ${res.statusText}`, res.status);
  }
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value;
    let cut: number;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const ev = parseEvent(block);
      if (ev) onEvent(ev);
    }
  }
}

function parseEvent(block: string): RunEvent | null {
  let event = "message";
  const data: string[] = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
  }
  if (!data.length) return null;
  return { event, data: JSON.parse(data.join("\n")) } as RunEvent;
}

/** Follow an ingestion job's progress (server-sent events) until it is done or failed. */
export function followJob(id: string, onUpdate: (job: Job) => void): Promise<Job> {
  return new Promise((resolve, reject) => {
    const source = new EventSource(`/api/jobs/${id}/events`);
    const handle = (e: MessageEvent) => {
      const job = JSON.parse(e.data) as Job;
      onUpdate(job);
      if (job.state === "done" || job.state === "failed") {
        source.close();
        resolve(job);
      }
    };
    source.addEventListener("progress", handle);
    source.addEventListener("done", handle);
    source.addEventListener("failed", handle);
    source.onerror = () => {
      source.close();
      reject(new ApiError("lost the connection to the server", 0));
    };
  });
}
