// The retrieved chunks beside the question: score, source, text with the anchors marked.
import type { ChunkHit } from "./api";

interface Props {
  chunks: ChunkHit[];
  selected: Set<string>;
  onToggle: (id: string) => void;
}

export function Chunks({ chunks, selected, onToggle }: Props) {
  if (!chunks.length) return <p className="muted">No chunks yet: ask a question to retrieve some.</p>;
  return (
    <ol className="chunks" data-testid="chunk-list">
      {chunks.map((c, i) => {
        const anchors = new Set(c.anchors);
        return (
          <li key={c.id} className={`chunk ${selected.has(c.id) ? "" : "off"}`} data-testid="chunk-card"
              data-chunk-id={c.id} data-source={c.source}>
            <label className="chunk-head">
              <input type="checkbox" checked={selected.has(c.id)} onChange={() => onToggle(c.id)}
                     data-testid="chunk-select" aria-label={`use chunk ${i + 1} (${c.source})`} />
              <span className="rank">#{i + 1}</span>
              <span className="source" title={c.id}>{c.source}</span>
              <span className="score" title="cosine similarity to the question">{c.score.toFixed(3)}</span>
            </label>
            <p className="chunk-text">
              {c.tokens.map((t, j) => (
                <span key={j} className={anchors.has(j) ? "anchor" : undefined}
                      title={anchors.has(j) ? "anchor (layer 0): stands for this chunk in the probe" : undefined}>
                  {t}
                </span>
              ))}
            </p>
            <p className="chunk-foot muted">
              {c.tokens.length} tokens · {c.cached ? `${c.anchors.length} anchors marked` : "no cache for this model yet"}
            </p>
          </li>
        );
      })}
    </ol>
  );
}
