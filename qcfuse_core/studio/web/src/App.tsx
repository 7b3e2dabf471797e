// QCFuse Studio: ask a question, pick the retrieved chunks, run several cache modes side by
// side, and open the details of one to see which tokens fusion recomputed and why.
import { useCallback, useEffect, useRef, useState } from "react";

import { Answers, type Card } from "./Answers";
import { api, type ChunkHit, type Details as DetailsData, followJob, type Job, type ModelInfo, type RunResponse, type Status, streamRun } from "./api";
import { Chunks } from "./Chunks";
import { Details } from "./Details";
import { Upload } from "./Upload";

const RATIO_METHODS = new Set(["qcfuse", "cacheblend", "epic", "random", "qcall", "qclast"]);
const DEFAULT_MODES = ["qcfuse", "full"];

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
  const [ratio, setRatio] = useState(0.15);
  const [running, setRunning] = useState(false);
  const [cards, setCards] = useState<Card[]>([]);
  const [run, setRun] = useState<RunResponse | null>(null);
  const [reference, setReference] = useState<{ answer: string; ttft_ms: number } | null>(null);
  const [detailsIndex, setDetailsIndex] = useState<number | null>(null);
  const [details, setDetails] = useState<DetailsData | null>(null);

  const searchSeq = useRef(0); // only the latest search's answer is shown
  const search = useCallback(async (q: string, k: number) => {
    if (!q.trim()) {
      setError("type a question first");
      return;
    }
    const seq = ++searchSeq.current;
    setError(null);
    setSearching(true);
    try {
      const res = await api.search(q, k);
      if (seq !== searchSeq.current) return;
      setChunks(res.chunks);
      setSelected(new Set(res.chunks.map((c) => c.id)));
    } catch (e) {
      if (seq === searchSeq.current) setError((e as Error).message);
    } finally {
      if (seq === searchSeq.current) setSearching(false);
    }
  }, []);

  useEffect(() => {
    (async () => {
      try {
        const [st, ms] = await Promise.all([api.status(), api.models()]);
        setStatus(st);
        setModels(ms.models);
        setRatio(st.default_ratio);
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
    setDetailsIndex(null);
    setDetails(null);
  }

  async function start() {
    const ids = chunks.filter((c) => selected.has(c.id)).map((c) => c.id);
    if (!ids.length) return setError("select at least one chunk");
    if (!modes.length) return setError("select at least one mode");
    setError(null);
    clearRun();
    setRunning(true);
    try {
      await streamRun(
        { question, chunk_ids: ids, modes: modes.map((method) => ({ method, ratio })) },
        (ev) => {
          switch (ev.event) {
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
      clearRun();
      if (await followModelJob(job) && question.trim()) await search(question, topK);
    } catch (e) {
      setError((e as Error).message);
    }
  }

  async function ingested(job: Job) {
    setStatus(await api.status());
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
                <option key={m.id} value={m.id} data-testid={`model-option-${m.id}`}>
                  {m.name}{m.instruct === false ? " (base)" : ""}{m.converted === false ? " · converted on first use" : ""}
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
                      placeholder="Ask a question about the documents" data-testid="question-input" />
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
            <label className="ratio">
              <span>recompute ratio <strong data-testid="ratio-value">{ratio.toFixed(2)}</strong></span>
              <input type="range" min={0} max={1} step={0.01} value={ratio} disabled={busy}
                     onChange={(e) => setRatio(Number(e.target.value))} data-testid="ratio-slider" />
              <span className="muted">for {modes.filter((m) => RATIO_METHODS.has(m)).join(", ") || "no selected mode"}</span>
            </label>
            <button className="primary" onClick={start} disabled={busy || !chunks.length} data-testid="run-button">
              {running ? "running…" : `Run ${modes.length} mode${modes.length === 1 ? "" : "s"}`}
            </button>
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
          {cards.length ? (
            <Answers cards={cards} reference={reference} final={run !== null} onDetails={toggleDetails} detailsIndex={detailsIndex} />
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
      <footer className="muted">
        Everything runs on this machine: the page, its fonts and the model are local files. Stage timings are the
        engine's own (synchronised at each stage boundary); peak memory on a CPU is the process's high-water mark.
      </footer>
    </div>
  );
}
