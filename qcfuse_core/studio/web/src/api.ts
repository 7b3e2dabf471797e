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
  default_ratio: number;
  examples: string[];
  limits: { max_upload_bytes: number; max_files: number; max_chunks: number; max_modes: number; suffixes: string[] };
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
  peak_bytes: number;
  peak_kind: string;
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
  ttft_ms: number;
  total_ms: number;
  stages: Stage[];
  context_tokens: number;
  prompt_tokens: number;
  recomputed_tokens: number;
  recompute_share: number;
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
  results: ModeResult[];
  reference: { answer: string; ttft_ms: number } | null;
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
  models: () => call<{ current: string; models: ModelInfo[] }>("/api/models"),
  selectModel: (id: string) => call<Job>("/api/models/select", json({ id })),
  search: (question: string, top_k: number) =>
    call<{ question: string; chunks: ChunkHit[] }>("/api/search", json({ question, top_k })),
  details: (runId: string, index: number) => call<Details>(`/api/runs/${runId}/details/${index}`),
  ingest: (files: File[]) => {
    const form = new FormData();
    for (const f of files) form.append("files", f, f.name);
    return call<Job>("/api/ingest", { method: "POST", body: form });
  },
};

export type RunEvent =
  | { event: "mode"; data: { index: number; method: string; ratio: number; label: string } }
  | { event: "delta"; data: { index: number; text: string } }
  | { event: "result"; data: ModeResult }
  | { event: "reference"; data: { state: string; answer?: string; ttft_ms?: number } }
  | { event: "done"; data: RunResponse }
  | { event: "error"; data: { message: string; type: string } };

/** POST /api/run/stream and hand each server-sent event to `onEvent` as it arrives. */
export async function streamRun(
  body: { question: string; chunk_ids: string[]; modes: Mode[]; max_new_tokens?: number },
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
