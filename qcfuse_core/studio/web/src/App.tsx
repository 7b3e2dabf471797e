// QCFuse Studio: ask a question, pick the retrieved chunks, run several cache modes side by
// side, and open the details of one to see which tokens fusion recomputed and why.
import { useCallback, useEffect, useRef, useState } from "react";

import { Answers, type Card } from "./Answers";
import { api, type Build, type ChunkHit, type Details as DetailsData, followJob, type HistoryRow, type Job, type ModelInfo, type Reference, type RunResponse, type Status, streamRun } from "./api";
import { Chunks } from "./Chunks";
import { Details } from "./Details";
import { History } from "./History";
import { Tiers } from "./Tiers";
import { Upload } from "./Upload";

const RATIO_METHODS = new Set(["qcfuse", "adaptive", "cacheblend", "epic", "random", "qcall", "qclast"]);
const DEFAULT_MODES = ["qcfuse", "full"];
const DEFAULT_REPEATS = 3;

/** A model's menu label, short enough for a phone-width screen. */
function optionLabel(m: ModelInfo): string {
  return `${m.name}${m.instruct === false ? " (base)" : ""}${m.converted === false ? " · converts once" : ""}`;
}

export function App() {
  const [status, setStatus] = useState<Status | null>(null);
  const [models, setModels] = useState<ModelInfo[]>([]);
  const [switching, setSwitching] = useState(false);
  const [modelJob, setModelJob] = useState<Job | null>(null); // the switch in progress: its stage message
  const [error, setError] = useState<string | null>(null);
  const [question, setQuestion] = useState("");
  const [topK, setTopK] = useState(4);
  const [chunks, setChunks] = useState<ChunkHit[]>([]);
  const [selected, setSelected] = useState<Set<string>>(new Set());
  const [searching, setSearching] = useState(false);
  const [modes, setModes] = useState<string[]>(DEFAULT_MODES);
  const [ratios, setRatios] = useState<Record<string, number>>({}); // per mode; the default ratio otherwise
  const [repeats, setRepeats] = useState(DEFAULT_REPEATS);
  const [newTokens, setNewTokens] = useState(48);
  const [running, setRunning] = useState(false);
  const [cards, setCards] = useState<Card[]>([]);
  const [run, setRun] = useState<RunResponse | null>(null);
  const [reference, setReference] = useState<Reference | null>(null);
  const [build, setBuild] = useState<(Partial<Build> & { state: string }) | null>(null);
  const [history, setHistory] = useState<HistoryRow[]>([]);
  const [tiersTick, setTiersTick] = useState(0); // the tier table is fetched again when it changes
  const [retrievedFor, setRetrievedFor] = useState<string | null>(null); // the question the chunks are for
  const [detailsIndex, setDetailsIndex] = useState<number | null>(null);
  const [details, setDetails] = useState<DetailsData | null>(null);

  const searchSeq = useRef(0); // only the latest search's answer is shown
  // -> the chunks retrieved for q (null: failed or superseded by a later search)
  const search = useCallback(async (q: string, k: number): Promise<ChunkHit[] | null> => {
    if (!q.trim()) {
      setError("type a question first");
      return null;
    }
    const seq = ++searchSeq.current;
    setError(null);
    setSearching(true);
    try {
      const res = await api.search(q, k);
      if (seq !== searchSeq.current) return null;
      setChunks(res.chunks);
      setSelected(new Set(res.chunks.map((c) => c.id)));
      setRetrievedFor(q.trim());
      return res.chunks;
    } catch (e) {
      if (seq === searchSeq.current) setError((e as Error).message);
      return null;
    } finally {
      if (seq === searchSeq.current) setSearching(false);
    }
  }, []);

  useEffect(() => {
    (async () => {
      try {
        const [st, ms, hist] = await Promise.all([api.status(), api.models(), api.history()]);
        setStatus(st);
        setModels(ms.models);
        setHistory(hist.rows);
        setNewTokens(st.limits.max_new_tokens);
        if (st.loading) await followModelJob(st.loading); // the page was opened during a switch
        if (st.examples.length) {
          setQuestion(st.examples[0]);
          await search(st.examples[0], 4);
        }
      } catch (e) {
        setError(`cannot reach the studio server: ${(e as Error).message}`);
      }
    })();
  }, [search]);

  function clearRun() {
    setCards([]);
    setRun(null);
    setReference(null);
    setBuild(null);
    setDetailsIndex(null);
    setDetails(null);
  }

  const ratioOf = (m: string): number => {
    const r = ratios[m] ?? status?.default_ratio ?? 0.15;
    const shares = status?.adaptive_shares ?? [];
    return m === "adaptive" && shares.length ? Math.min(shares[shares.length - 1], Math.max(shares[0], r)) : r;
  };

  async function start() {
    if (!modes.length) return setError("select at least one mode");
    let hits: ChunkHit[] | null = chunks;
    let ids = chunks.filter((c) => selected.has(c.id)).map((c) => c.id);
    if (question.trim() !== retrievedFor) { // a new question: retrieve its own chunks first
      hits = await search(question, topK);
      if (!hits) return;
      ids = hits.map((c) => c.id);
    }
    if (!ids.length) return setError("select at least one chunk");
    setError(null);
    clearRun();
    setRunning(true);
    try {
      await streamRun(
        { question, chunk_ids: ids, modes: modes.map((method) => ({ method, ratio: ratioOf(method) })), repeats,
          max_new_tokens: newTokens },
        (ev) => {
          switch (ev.event) {
            case "build":
              setBuild(ev.data);
              break;
            case "reference":
              if (ev.data.state === "running") setReference(null);
              break;
            case "mode":
              setCards((cs) => [...cs, { index: ev.data.index, label: ev.data.label, method: ev.data.method, answer: "" }]);
              break;
            case "delta":
              setCards((cs) => cs.map((c) => (c.index === ev.data.index ? { ...c, answer: c.answer + ev.data.text } : c)));
              break;
            case "result":
              setCards((cs) => cs.map((c) => (c.index === ev.data.index ? { ...c, answer: ev.data.answer, result: ev.data } : c)));
              break;
            case "done":
              setRun(ev.data);
              setReference(ev.data.reference);
              setCards(ev.data.results.map((r) => ({ index: r.index, label: r.label, method: r.method, answer: r.answer, result: r })));
              setHistory((h) => [...h, ...ev.data.history]);
              break;
            case "error":
              setError(ev.data.message);
              break;
          }
        },
      );
    } catch (e) {
      setError((e as Error).message);
    } finally {
      setRunning(false);
      setTiersTick((t) => t + 1);
    }
    try { // the cards as they are now: the run built this model's caches of its chunks
      const fresh = new Map((await api.chunks(ids)).chunks.map((c) => [c.id, c]));
      setChunks((cs) => cs.map((c) => ({ ...c, ...fresh.get(c.id) }))); // cached + anchors now; the score stays
    } catch (e) {
      setError((e as Error).message);
    }
  }

  async function clearHistory() {
    try {
      setHistory((await api.clearHistory()).rows);
    } catch (e) {
      setError((e as Error).message);
    }
  }

  async function toggleDetails(index: number) {
    if (!run) return;
    if (detailsIndex === index) {
      setDetailsIndex(null);
      setDetails(null);
      return;
    }
    setDetailsIndex(index);
    setDetails(null);
    try {
      setDetails(await api.details(run.run_id, index));
    } catch (e) {
      setError((e as Error).message);
    }
  }

  // A switch is a job on the server: converting (a packaged model's first use only), loading,
  // warming up; its message shows until the model answers.
  async function followModelJob(job: Job): Promise<boolean> {
    setSwitching(true);
    setModelJob(job);
    try {
      const end = job.state === "done" || job.state === "failed" ? job : await followJob(job.id, setModelJob);
      if (end.state === "failed") {
        setError(`the model could not be loaded: ${end.error}`);
        return false;
      }
      const [st, ms] = await Promise.all([api.status(), api.models()]);
      setStatus(st);
      setModels(ms.models);
      return true;
    } finally {
      setModelJob(null);
      setSwitching(false);
    }
  }

  async function switchModel(id: string) {
    setError(null);
    try {
      const job = await api.selectModel(id);
      setDetailsIndex(null); // the answers stay (labelled with their model), the history keeps every run
      setDetails(null);
      if (await followModelJob(job) && question.trim()) await search(question, topK);
    } catch (e) {
      setError((e as Error).message);
    }
  }

  async function ingested(job: Job) {
    setStatus(await api.status());
    setTiersTick((t) => t + 1);
    if (job.result?.chunks && question.trim()) await search(question, topK);
  }

  const toggleMode = (m: string) =>
    setModes((ms) => (ms.includes(m) ? ms.filter((x) => x !== m) : [...ms, m].sort(
      (a, b) => (status?.methods.indexOf(a) ?? 0) - (status?.methods.indexOf(b) ?? 0))));
  const busy = running || switching;

  return (
    <div className="app">
      <header className="top">
        <h1><span className="logo">QC</span>Fuse Studio</h1>
        <div className="top-info">
          <label className="model">
            <span className="muted">model</span>
            <select value={status?.model.id ?? ""} disabled={busy || !status} data-testid="model-select"
                    onChange={(e) => switchModel(e.target.value)}>
              {models.map((m) => (
                <option key={m.id} value={m.id} data-testid={`model-option-${m.id}`}
                        title={m.converted === false ? "converted from its GGUF the first time it is chosen" : undefined}>
                  {optionLabel(m)}
                </option>
              ))}
            </select>
          </label>
          {status && (
            <span className="muted" data-testid="store-info">
              {status.chunks} chunks · {status.model.layers} layers · {status.model.device} {status.model.dtype}
            </span>
          )}
        </div>
      </header>

      {switching && (
        <div className="notice" role="status" data-testid="model-loading" data-stage={modelJob?.stage ?? ""}>
          <span className="spinner">{modelJob?.result?.message ?? "loading the model…"}</span>
        </div>
      )}

      {error && <div className="error" role="alert" data-testid="error">{error}</div>}

      <main className="layout">
        <section className="left">
          <form className="ask" onSubmit={(e) => { e.preventDefault(); search(question, topK); }}>
            <textarea value={question} onChange={(e) => setQuestion(e.target.value)} rows={2}
                      onKeyDown={(e) => { // Enter retrieves; Shift+Enter is a new line
                        if (e.key === "Enter" && !e.shiftKey && !e.nativeEvent.isComposing) {
                          e.preventDefault();
                          if (!searching && !busy) search(question, topK);
                        }
                      }}
                      placeholder="Ask a question about the documents (Enter retrieves)" data-testid="question-input" />
            <div className="ask-row">
              <label className="muted">top-k
                <input type="number" min={1} max={status?.limits.max_chunks ?? 8} value={topK}
                       onChange={(e) => setTopK(Math.max(1, Number(e.target.value) || 1))} data-testid="top-k" />
              </label>
              <button type="submit" disabled={searching || busy} data-testid="search-button">
                {searching ? "searching…" : "Retrieve"}
              </button>
            </div>
            {!!status?.examples.length && (
              <div className="examples">
                {status.examples.map((q) => (
                  <button type="button" key={q} className="chip small"
                          onClick={() => { setQuestion(q); search(q, topK); }}>{q}</button>
                ))}
              </div>
            )}
          </form>
          {status && <Upload suffixes={status.limits.suffixes} maxBytes={status.limits.max_upload_bytes} onIngested={ingested} />}
          <h2>Retrieved chunks</h2>
          <Chunks chunks={chunks} selected={selected}
                  onToggle={(id) => setSelected((s) => { const n = new Set(s); if (n.has(id)) n.delete(id); else n.add(id); return n; })} />
        </section>

        <section className="right">
          <div className="modes">
            <div className="chips" role="group" aria-label="cache modes">
              {(status?.methods ?? []).map((m) => (
                <button key={m} className={`chip ${modes.includes(m) ? "on" : ""}`} aria-pressed={modes.includes(m)}
                        onClick={() => toggleMode(m)} data-testid={`mode-${m}`} disabled={busy}>{m}</button>
              ))}
            </div>
            <div className="ratios">
              {modes.filter((m) => RATIO_METHODS.has(m)).map((m) => {
                const shares = m === "adaptive" ? status?.adaptive_shares ?? [] : [];
                const lo = shares.length ? shares[0] : 0, hi = shares.length ? shares[shares.length - 1] : 1;
                return (
                  <label key={m} className="ratio">
                    <span>{m} ratio <strong data-testid={`ratio-value-${m}`}>{ratioOf(m).toFixed(2)}</strong>
                      {m === "adaptive" && <span className="muted"> (mean share, calibrated {lo}–{hi})</span>}</span>
                    <input type="range" min={lo} max={hi} step={0.01} value={ratioOf(m)} disabled={busy}
                           onChange={(e) => setRatios((r) => ({ ...r, [m]: Number(e.target.value) }))}
                           data-testid={`ratio-${m}`} aria-label={`${m} recompute ratio`} />
                  </label>
                );
              })}
            </div>
            <div className="run-row">
              <label className="muted" title="each mode answers N times; the TTFT shown is the median">repeats
                <input type="number" min={1} max={status?.limits.max_repeats ?? 10} value={repeats} disabled={busy}
                       onChange={(e) => setRepeats(Math.max(1, Math.min(status?.limits.max_repeats ?? 10, Number(e.target.value) || 1)))}
                       data-testid="repeats" />
              </label>
              <label className="muted">new tokens
                <input type="number" min={1} max={256} value={newTokens} disabled={busy}
                       onChange={(e) => setNewTokens(Math.max(1, Math.min(256, Number(e.target.value) || 1)))}
                       data-testid="new-tokens" />
              </label>
              <button className="primary" onClick={start} disabled={busy || searching || !question.trim()} data-testid="run-button">
                {running ? "running…" : `Run ${modes.length} mode${modes.length === 1 ? "" : "s"} × ${repeats}`}
              </button>
            </div>
          </div>
          {status?.model.prompt_frame && (
            <details className="frame" data-testid="prompt-frame" data-kind={status.model.prompt_frame.kind}>
              <summary>prompt frame of {status.model.name}: <strong>{status.model.prompt_frame.label}</strong></summary>
              <pre data-testid="prompt-frame-text">{status.model.prompt_frame.text}</pre>
              {!!status.model.prompt_frame.stop.length && (
                <p className="muted" data-testid="prompt-frame-stop">
                  answers end at {status.model.prompt_frame.stop.map((x) => JSON.stringify(x)).join(", ")}: a base model
                  has no end of turn and goes on with a next question
                </p>
              )}
            </details>
          )}
          {build && (
            <p className="build muted" data-testid="build-step" data-state={build.state}>
              {build.state === "running" ? <span className="spinner">building the chunk caches this model lacks…</span>
                : `build: ${build.built} chunk cache${build.built === 1 ? "" : "s"} built in ${(build.ms ?? 0).toFixed(1)} ms, ` +
                  `${build.cached} already cached; done before any mode was timed`}
            </p>
          )}
          {cards.length ? (
            <Answers cards={cards} reference={reference} final={run !== null} onDetails={toggleDetails} detailsIndex={detailsIndex}
                     modelName={run?.model_name ?? status?.model.name ?? ""} />
          ) : (
            <p className="muted hint">Pick modes and press run: each mode answers from the same chunks, one after another, and
              shows its time to first token. Full prefill is the reference the others are compared with.</p>
          )}
          {detailsIndex !== null && (
            details ? <Details key={`${run?.run_id}-${detailsIndex}`} details={details} chunks={chunks}
                               onClose={() => { setDetailsIndex(null); setDetails(null); }} />
              : <p className="muted details-loading">loading details…</p>
          )}
        </section>
      </main>
      <History rows={history} memoryKind={status?.memory_kind ?? ""} onClear={clearHistory} />
      <Tiers tick={tiersTick} />
      <footer className="muted">
        Everything runs on this machine: the page, its fonts and the model are local files. Stage timings are the
        engine's own (synchronised at each stage boundary); memory is each run's own: {status?.memory_kind ?? ""}.
      </footer>
    </div>
  );
}
