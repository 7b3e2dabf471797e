// The run history: one row per mode of every run (model x mode x ratio), kept across mode,
// ratio and model changes (the server keeps it), and the quality-vs-TTFT plot of its rows.
// Every number is the API's (computed in Python); the page only formats it.
import { useState } from "react";

import type { HistoryRow } from "./api";
import { bytes, ms, pct } from "./format";

interface Props {
  rows: HistoryRow[];
  memoryKind: string;
  onClear: () => void;
}

export const klText = (x: number): string => x.toFixed(4);
export const matchText = (x: number): string => pct(x);
export const sameText = (x: boolean): string => (x ? "yes" : "no");

const COLOURS: Record<string, string> = {
  qcfuse: "#4f46e5", adaptive: "#0ea5e9", cacheblend: "#f97316", epic: "#a855f7", naive: "#64748b", full: "#16a34a",
};

export function History({ rows, memoryKind, onClear }: Props) {
  if (!rows.length) {
    return (
      <section className="history" data-testid="history">
        <h2>Run history</h2>
        <p className="muted">Each run adds one row per mode here: the median TTFT of its repeats beside its quality
          against full prefill on the same model and chunks. Rows stay when you change modes, ratios or the model.</p>
      </section>
    );
  }
  return (
    <section className="history" data-testid="history">
      <header className="history-head">
        <h2>Run history <span className="muted">({rows.length} rows)</span></h2>
        <button className="link" onClick={onClear} data-testid="clear-history">clear</button>
      </header>
      <QualityPlot rows={rows} />
      <div className="table-wrap">
        <table className="history-table" data-testid="history-table">
          <thead>
            <tr>
              <th>model</th><th>mode</th><th title="TTFT: median of the repeats">TTFT</th><th>N</th>
              <th title="decode tokens per second after the first token (median)">decode</th>
              <th title="end to end: first token and decoding (median)">total</th>
              <th title="KL(full || mode) of the first token's distribution, nats (0: identical)">first-token KL</th>
              <th title="share of full prefill's greedy answer tokens this answer matches, in order (LCS)">tokens = full</th>
              <th title="the same answer as full prefill's (whitespace aside)">same answer</th>
              <th title={memoryKind}>memory</th><th>question</th>
            </tr>
          </thead>
          <tbody>
            {rows.map((r) => (
              <tr key={`${r.run_id}-${r.index ?? "ref"}`} data-testid="history-row" data-run-id={r.run_id}
                  data-index={r.index ?? "ref"} data-model={r.model} data-method={r.method}
                  data-ratio={r.ratio ?? ""}>
                <td>{r.model_name}</td>
                <td><span className="dot" style={{ background: COLOURS[r.method] ?? "#334155" }} />{r.label}
                  {r.ran_as !== r.method && <span className="muted"> (ran as {r.ran_as})</span>}</td>
                <td className="num" data-testid="h-ttft">{ms(r.ttft_ms)}</td>
                <td className="num">{r.repeats}</td>
                <td className="num" data-testid="h-decode">{r.decode_tok_s === null ? "–" : `${r.decode_tok_s.toFixed(1)} tok/s`}</td>
                <td className="num" data-testid="h-total">{ms(r.total_ms)}</td>
                <td className="num" data-testid="h-kl">{r.quality ? klText(r.quality.kl_first_token) : "–"}</td>
                <td className="num" data-testid="h-match">{r.quality ? matchText(r.quality.token_match) : "–"}</td>
                <td className={`num ${r.quality ? (r.quality.answer_matches ? "good" : "bad") : ""}`} data-testid="h-same">
                  {r.quality ? sameText(r.quality.answer_matches) : "–"}</td>
                <td className="num">{r.memory.peak_bytes === null ? "–" : bytes(r.memory.peak_bytes)}</td>
                <td className="q" title={r.question}>{r.question}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
      <p className="muted small">Quality is measured against full prefill on the same model, question and chunks (its
        own row reads KL 0, 100%). Memory: {memoryKind}.</p>
    </section>
  );
}

type Axis = "match" | "kl";

/** Quality against TTFT, one point per row with a quality, drawn as SVG (no chart library). */
function QualityPlot({ rows }: { rows: HistoryRow[] }) {
  const [axis, setAxis] = useState<Axis>("kl");
  const pts = rows.filter((r) => r.quality !== null);
  if (!pts.length) return null;
  const W = 560, H = 220, L = 58, R = 12, T = 12, B = 34;
  const xmax = Math.max(...pts.map((r) => r.ttft_ms)) * 1.08 || 1;
  const y = (r: HistoryRow) => (axis === "match" ? r.quality!.token_match : r.quality!.kl_first_token);
  const ymax = axis === "match" ? 1 : Math.max(1e-3, ...pts.map(y)) * 1.1;
  const px = (v: number) => L + ((W - L - R) * v) / xmax;
  // KL: lower is better, drawn with 0 at the top so "better" is up on both axes
  const py = (v: number) => (axis === "match" ? T + (H - T - B) * (1 - v / ymax) : T + ((H - T - B) * v) / ymax);
  const xt = [0, 0.25, 0.5, 0.75, 1].map((f) => f * xmax);
  const yt = [0, 0.5, 1].map((f) => f * ymax);
  const models = [...new Set(pts.map((r) => r.model))];
  return (
    <figure className="plot" data-testid="quality-plot" data-axis={axis}>
      <figcaption>
        <span>Quality against time to first token (better is up and left)</span>
        <select value={axis} onChange={(e) => setAxis(e.target.value as Axis)} data-testid="plot-axis">
          <option value="kl">first-token KL vs full</option>
          <option value="match">answer tokens = full</option>
        </select>
      </figcaption>
      <svg viewBox={`0 0 ${W} ${H}`} role="img" aria-label="quality against TTFT">
        <rect x={L} y={T} width={W - L - R} height={H - T - B} className="plot-bg" />
        {xt.map((v) => (
          <g key={`x${v}`}>
            <line x1={px(v)} x2={px(v)} y1={T} y2={H - B} className="grid-line" />
            <text x={px(v)} y={H - B + 14} textAnchor="middle">{v >= 1000 ? `${(v / 1000).toFixed(1)} s` : `${v.toFixed(0)} ms`}</text>
          </g>
        ))}
        {yt.map((v) => (
          <g key={`y${v}`}>
            <line x1={L} x2={W - R} y1={py(v)} y2={py(v)} className="grid-line" />
            <text x={L - 6} y={py(v) + 4} textAnchor="end">{axis === "match" ? `${(100 * v).toFixed(0)}%` : v.toFixed(3)}</text>
          </g>
        ))}
        <text x={(L + W - R) / 2} y={H - 4} textAnchor="middle" className="axis-label">TTFT (median)</text>
        <text x={12} y={(T + H - B) / 2} textAnchor="middle" className="axis-label"
              transform={`rotate(-90 12 ${(T + H - B) / 2})`}>{axis === "match" ? "tokens = full" : "KL (0 at top)"}</text>
        {pts.map((r) => {
          const shape = models.indexOf(r.model) % 2;
          const cx = px(r.ttft_ms), cy = py(y(r));
          const tip = `${r.model_name} · ${r.label}: TTFT ${ms(r.ttft_ms)}, KL ${klText(r.quality!.kl_first_token)}, ` +
            `${matchText(r.quality!.token_match)} of full's tokens`;
          const fill = COLOURS[r.method] ?? "#334155";
          return shape === 0 ? (
            <circle key={`${r.run_id}-${r.index}`} cx={cx} cy={cy} r={5} fill={fill} data-testid="plot-point"
                    data-model={r.model} data-method={r.method}><title>{tip}</title></circle>
          ) : (
            <rect key={`${r.run_id}-${r.index}`} x={cx - 4.5} y={cy - 4.5} width={9} height={9} fill={fill}
                  data-testid="plot-point" data-model={r.model} data-method={r.method}><title>{tip}</title></rect>
          );
        })}
      </svg>
      <div className="plot-legend">
        {[...new Set(pts.map((r) => r.method))].map((m) => (
          <span key={m}><span className="dot" style={{ background: COLOURS[m] ?? "#334155" }} />{m}</span>
        ))}
        {models.map((m, i) => (
          <span key={m} className="muted">{i % 2 === 0 ? "●" : "■"} {pts.find((r) => r.model === m)!.model_name}</span>
        ))}
      </div>
    </figure>
  );
}
