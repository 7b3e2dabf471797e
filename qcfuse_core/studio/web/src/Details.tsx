// "View details" of one mode: the token grid per chunk coloured by recompute depth, the layer
// slider, the heat strip of the method's scores, the timing waterfall and memory per tier.
import { useMemo, useState } from "react";

import type { ChunkHit, ChunkStat, Details as DetailsData, TokenInfo } from "./api";
import { bytes, depthColour, ms, TIER_NAMES } from "./format";

interface Props {
  details: DetailsData;
  chunks: ChunkHit[];
  onClose: () => void;
}

export function Details({ details, chunks, onClose }: Props) {
  const L = details.num_layers;
  const [layer, setLayer] = useState(L - 1);
  const bySeg = useMemo(() => {
    const out: TokenInfo[][] = details.segments.map(() => []);
    for (const t of details.tokens) out[t.seg].push(t);
    return out;
  }, [details]);
  const maxScore = useMemo(
    () => Math.max(0, ...details.tokens.map((t) => (t.score !== null && t.score > 0 ? t.score : 0))),
    [details],
  );
  const rowsHere = details.tokens.filter((t) => t.depth > layer).length;
  const names = new Map(chunks.map((c, i) => [c.id, `#${i + 1} ${c.source}`]));
  const stats = new Map(details.explanation.chunks.map((c) => [c.segment, c]));
  return (
    <section className="details" data-testid="details-panel" data-index={details.index}>
      <header className="details-head">
        <h2>Details · {details.label}</h2>
        <button className="link" onClick={onClose}>close</button>
      </header>
      <p className="muted">{selectionNote(details)}</p>
      <div className="why" data-testid="why">
        <h3>Why these tokens</h3>
        {details.explanation.text.map((t, i) => <p key={i}>{t}</p>)}
      </div>

      <div className="layer-control">
        <label htmlFor="layer">
          Layer <strong data-testid="layer-value">{layer}</strong> of {L - 1}:{" "}
          <span data-testid="layer-rows">{rowsHere}</span> of {details.tokens.length} context tokens recomputed
        </label>
        <input id="layer" type="range" min={0} max={L - 1} step={1} value={layer}
               onChange={(e) => setLayer(Number(e.target.value))} data-testid="layer-slider" />
        <LayerRuler details={details} layer={layer} />
      </div>

      <Legend layers={L} scoreKind={details.score_kind} />

      <div className="grid" data-testid="token-grid">
        {details.segments.map((s, si) =>
          s.kind === "chunk" ? (
            <div key={si} className="seg-chunk" data-testid="grid-chunk" data-node-id={s.node_id ?? ""}>
              <div className="seg-head">
                <span>{(s.node_id && names.get(s.node_id)) || `chunk ${si + 1}`}</span>
                <span className="muted">positions {s.start}–{s.end - 1} · cache {s.cache_hit ? "hit" : "miss (built now)"}</span>
              </div>
              {stats.get(si) && <ChunkNumbers stat={stats.get(si)!} kind={details.score_kind}
                                              window={details.explanation.start_window} />}
              <Tokens tokens={bySeg[si]} layer={layer} layers={L} />
              {details.score_kind && <HeatStrip tokens={bySeg[si]} max={maxScore} kind={details.score_kind}
                                                start={s.start} />}
            </div>
          ) : (
            <div key={si} className="seg-glue" title="glue between chunks: no cache, always recomputed">
              <span className="muted">glue</span>
              <Tokens tokens={bySeg[si]} layer={layer} layers={L} />
            </div>
          ),
        )}
      </div>

      <div className="details-bottom">
        <Waterfall details={details} />
        <MemoryView details={details} />
      </div>
    </section>
  );
}

function selectionNote(d: DetailsData): string {
  if (d.method === "full" || d.ran_as === "full") return "Full prefill: every token recomputed at every layer (the reference).";
  if (d.critical_layers.length)
    return `The probe ran the question against the prefix and the chunks' anchors and read the attention at critical layers ${[...d.critical_layers].sort((a, b) => a - b).join(", ")}; the tokens it chose were recomputed at every layer.`;
  if (d.row_sets.length > 1)
    return `Every token was recomputed at layers 0–${d.row_sets[1].from_layer - 1}; after layer ${d.row_sets[1].from_layer - 1} the rows narrowed to those whose values deviated most.`;
  if (d.method === "naive") return "Naive concatenation: only glue and the question are computed; every chunk token comes from its cache.";
  return "Rows chosen before the first layer, recomputed at every layer.";
}

function Tokens({ tokens, layer, layers }: { tokens: TokenInfo[]; layer: number; layers: number }) {
  return (
    <p className="tokens">
      {tokens.map((t) => {
        const hl = t.depth > layer;
        const cls = `tok${hl ? " hl" : ""}${t.anchor ? " anchor" : ""}`;
        const tip = [`position ${t.pos}`,
          t.depth ? `recomputed at layers 0–${t.depth - 1}` : "from its chunk cache at every layer",
          t.score !== null ? `score ${t.score.toPrecision(3)}` : "",
          t.anchor ? "anchor (layer 0)" : ""].filter(Boolean).join(" · ");
        return (
          <span key={t.pos} className={cls} data-testid="token" data-pos={t.pos} data-hl={hl ? "1" : "0"}
                data-depth={t.depth} title={tip}
                style={hl ? { background: depthColour(t.depth, layers) } : undefined}>
            {visible(t.text)}
          </span>
        );
      })}
    </p>
  );
}

/** Whitespace-only pieces made visible (a newline is shown as ↵ and still breaks the line). */
function visible(text: string): string {
  if (text === "") return "";
  if (!text.trim()) return text.includes("\n") ? text.replace(/\n/g, "↵\n") : text.replace(/ /g, "·");
  return text;
}

function ChunkNumbers({ stat, kind, window }: { stat: ChunkStat; kind: string | null; window: number }) {
  return (
    <p className="chunk-numbers" data-testid="chunk-numbers">
      {kind && stat.score_share !== null && <span>{kind}: <strong>{(100 * stat.score_share).toFixed(1)}%</strong> of the prompt's</span>}
      <span>recomputed <strong>{stat.recomputed}</strong> of {stat.tokens}</span>
      <span>{stat.recomputed_at_start} in its first {window} positions</span>
      <span>{stat.recomputed_filler} punctuation / filler</span>
      {stat.anchors > 0 && <span>{stat.anchors} anchors</span>}
    </p>
  );
}

/** The method's score per token of one chunk; hovering or touching a cell shows its numbers. */
function HeatStrip({ tokens, max, kind, start }: { tokens: TokenInfo[]; max: number; kind: string; start: number }) {
  const [at, setAt] = useState<TokenInfo | null>(null);
  const total = tokens.reduce((a, t) => a + (t.score !== null && t.score > 0 ? t.score : 0), 0);
  const tip = (t: TokenInfo) =>
    `${JSON.stringify(t.text)} at chunk position ${t.pos - start}: ${kind} ${t.score === null ? "–" : t.score.toPrecision(3)}` +
    (t.score !== null && total > 0 ? ` (${((100 * Math.max(0, t.score)) / total).toFixed(1)}% of this chunk's)` : "") +
    (t.depth ? " · recomputed" : "");
  return (
    <div className="heat-wrap">
      <div className="heat" data-testid="heat-strip" aria-label={`${kind} per token`}
           onPointerLeave={(e) => { if (e.pointerType === "mouse") setAt(null); }}>
        {tokens.map((t) => (
          // square root: the scores are heavy-tailed, a linear scale shows one spike per chunk
          <span key={t.pos} title={tip(t)} className={t.depth ? "rec" : undefined} data-testid="heat-cell"
                onPointerEnter={() => setAt(t)} onPointerDown={() => setAt(t)}
                style={{ opacity: max > 0 && t.score !== null && t.score > 0 ? Math.max(0.1, Math.sqrt(t.score / max)) : 0.1 }} />
        ))}
      </div>
      <p className="heat-readout muted" data-testid="heat-readout">
        {at ? tip(at) : `${kind} per token: hover or touch the strip for its numbers (darker: more)`}
      </p>
    </div>
  );
}

function LayerRuler({ details, layer }: { details: DetailsData; layer: number }) {
  const L = details.num_layers;
  const pos = (l: number) => `${(100 * (l + 0.5)) / L}%`;
  return (
    <div className="ruler" aria-hidden>
      {Array.from({ length: L }, (_, l) => (
        <span key={l} className={`tick ${l === layer ? "now" : ""}`} style={{ left: pos(l) }} />
      ))}
      {details.critical_layers.map((l) => (
        <span key={`c${l}`} className="mark crit" style={{ left: pos(l) }} title={`critical layer ${l}: the probe read it`}>◆</span>
      ))}
      {details.row_sets.slice(1).map((s) => (
        <span key={`n${s.from_layer}`} className="mark narrow" style={{ left: `${(100 * s.from_layer) / L}%` }}
              title={`rows narrowed before layer ${s.from_layer}`}>▼</span>
      ))}
    </div>
  );
}

function Legend({ layers, scoreKind }: { layers: number; scoreKind: string | null }) {
  const stops = [1, Math.round(layers / 3), Math.round((2 * layers) / 3), layers];
  return (
    <div className="legend">
      <span className="tok">reused from cache</span>
      {stops.map((d) => (
        <span key={d} className="tok hl" style={{ background: depthColour(d, layers) }}>
          recomputed at {d === layers ? "every layer" : `${d} layer${d > 1 ? "s" : ""}`}
        </span>
      ))}
      <span className="tok anchor">anchor</span>
      {scoreKind && <span className="muted">strip under each chunk: {scoreKind}</span>}
    </div>
  );
}

function Waterfall({ details }: { details: DetailsData }) {
  const total = Math.max(1e-6, ...details.stages.map((s) => s.start_ms + s.ms));
  return (
    <div className="waterfall" data-testid="waterfall">
      <h3>Time to first token · {ms(details.ttft_ms)}</h3>
      {details.stages.map((s) => (
        <div key={s.name} className="wf-row">
          <span className="wf-name">{s.name}</span>
          <span className="wf-track">
            <span className={`wf-bar wf-${s.name.replace(" ", "-")}`}
                  style={{ left: `${(100 * s.start_ms) / total}%`, width: `${Math.max(0.3, (100 * s.ms) / total)}%` }} />
          </span>
          <span className="wf-ms">{ms(s.ms)}</span>
        </div>
      ))}
      {details.memory.load_wait_ms > 0 && (
        <p className="muted">fuse waited {ms(details.memory.load_wait_ms)} for layer loads</p>
      )}
    </div>
  );
}

function MemoryView({ details }: { details: DetailsData }) {
  const m = details.memory;
  const tiers = Object.entries(m.kv_bytes_by_tier);
  const max = Math.max(1, ...tiers.map(([, n]) => n));
  return (
    <div className="memory" data-testid="memory">
      <h3>Memory</h3>
      <p>KV loaded: <strong>{bytes(m.kv_bytes_loaded)}</strong></p>
      {tiers.length ? tiers.map(([tier, n]) => (
        <div key={tier} className="wf-row">
          <span className="wf-name">{TIER_NAMES[tier] ?? tier}</span>
          <span className="wf-track"><span className="wf-bar mem" style={{ left: 0, width: `${(100 * n) / max}%` }} /></span>
          <span className="wf-ms">{bytes(n)}</span>
        </div>
      )) : <p className="muted">nothing loaded from chunk caches (full prefill computes every token)</p>}
      <p>This run: <strong data-testid="run-memory">{m.peak_bytes === null ? "not measured" : bytes(m.peak_bytes)}</strong>{" "}
        <span className="muted">({m.peak_kind}; the largest of its {details.repeats} repeats)</span></p>
    </div>
  );
}
