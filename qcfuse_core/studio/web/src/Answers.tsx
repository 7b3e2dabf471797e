// Answers side by side: TTFT bars, speedup over full prefill, agreement with full's answer.
import type { ModeResult, Reference } from "./api";
import { bytes, ms, pct } from "./format";
import { klText, matchText } from "./History";

export interface Card {
  index: number;
  label: string;
  method: string;
  answer: string;
  result?: ModeResult;
}

interface Props {
  cards: Card[];
  reference: Reference | null;
  final: boolean;
  onDetails: (index: number) => void;
  detailsIndex: number | null;
  modelName: string;
}

export function Answers({ cards, reference, final, onDetails, detailsIndex, modelName }: Props) {
  const maxTtft = Math.max(1, ...cards.map((c) => c.result?.ttft_ms ?? 0), reference?.ttft_ms ?? 0);
  return (
    <div className="answers" data-testid="answers">
      {cards.map((c) => {
        const r = c.result;
        return (
          <article key={c.index} className={`answer ${detailsIndex === c.index ? "open" : ""}`} data-testid="answer-card"
                   data-index={c.index} data-method={c.method}>
            <header>
              <h3>{c.label} <span className="muted model-tag">{modelName}</span></h3>
              {r && final && <Badge r={r} />}
            </header>
            <p className="answer-text" data-testid="answer-text">{c.answer || <span className="muted">…</span>}</p>
            {r && (
              <>
                <div className="ttft-row">
                  <div className="bar-track" aria-hidden>
                    <div className={`bar ${c.method === "full" ? "full" : ""}`}
                         style={{ width: `${(100 * r.ttft_ms) / maxTtft}%` }} />
                  </div>
                  <span className="ttft" data-testid="ttft" data-ttft={r.ttft_ms}
                        title={`TTFT of each repeat: ${r.ttft_all_ms.map(ms).join(", ")}`}>{ms(r.ttft_ms)}</span>
                </div>
                <dl className="facts">
                  <div><dt>TTFT</dt><dd>median of {r.repeats}</dd></div>
                  <div><dt>decode</dt>
                    <dd data-testid="decode">{r.decode_tok_s === null ? "–" : `${r.decode_tok_s.toFixed(1)} tok/s`}</dd></div>
                  <div><dt>end to end</dt><dd data-testid="total">{ms(r.total_ms)}</dd></div>
                  <div><dt>TTFT speedup vs full</dt>
                    <dd data-testid="speedup">{r.speedup_vs_full ? `${r.speedup_vs_full.toFixed(2)}×` : "–"}</dd></div>
                  <div><dt>recomputed</dt>
                    <dd>{r.recomputed_tokens}/{r.context_tokens} ({pct(r.recompute_share)})</dd></div>
                  <div><dt>chunk cache</dt><dd>{r.cache_hits} hits / {r.cache_misses} misses</dd></div>
                  <div className="wide">
                    <dt title={r.guard?.reason || "the method and ratio that answered, and what the quality guard did"}>what answered</dt>
                    <dd data-testid="answered">{r.answered}</dd></div>
                  {r.quality && <>
                    <div><dt title="KL(full || this mode) of the first token's distribution">first-token KL vs full</dt>
                      <dd data-testid="kl">{klText(r.quality.kl_first_token)}</dd></div>
                    <div><dt title="share of full prefill's greedy answer tokens matched, in order">answer tokens = full</dt>
                      <dd data-testid="match">{matchText(r.quality.token_match)}</dd></div>
                  </>}
                  <div><dt title={r.memory.peak_kind}>memory of this run</dt>
                    <dd>{r.memory.peak_bytes === null ? "–" : bytes(r.memory.peak_bytes)}</dd></div>
                </dl>
                {r.ran_as !== r.method && <p className="note">the planner ran this as {r.ran_as} prefill</p>}
                <button className="link" onClick={() => onDetails(c.index)} disabled={!final}
                        data-testid="details-button">{detailsIndex === c.index ? "hide details" : "view details"}</button>
              </>
            )}
          </article>
        );
      })}
      {reference && (
        <article className="answer reference" data-testid="reference-card">
          <header><h3>full prefill (reference) <span className="muted model-tag">{modelName}</span></h3></header>
          <p className="answer-text">{reference.answer}</p>
          <div className="ttft-row">
            <div className="bar-track" aria-hidden>
              <div className="bar full" style={{ width: `${(100 * reference.ttft_ms) / maxTtft}%` }} />
            </div>
            <span className="ttft">{ms(reference.ttft_ms)}</span>
          </div>
          {reference.repeats && <p className="muted small">median of {reference.repeats}; the others' quality is
            measured against this answer</p>}
        </article>
      )}
    </div>
  );
}

function Badge({ r }: { r: ModeResult }) {
  const a = r.agreement;
  if (r.method === "full") return <span className="badge ref" data-testid="agreement">full prefill</span>;
  if (!a) return null;
  if (a.same_text) return <span className="badge good" data-testid="agreement">same answer as full</span>;
  const title = `${a.common_prefix_tokens} of ${a.full_tokens} leading tokens as full prefill's answer`;
  return (
    <span className={`badge ${a.first_token_same ? "near" : "bad"}`} data-testid="agreement" title={title}>
      {a.first_token_same ? `differs after ${a.common_prefix_tokens} tokens` : "differs from full"}
    </span>
  );
}
