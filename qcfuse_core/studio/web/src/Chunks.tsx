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
              {c.tokens.map((_, j) => (
                <span key={j} className={anchors.has(j) ? "anchor" : undefined}
                      title={anchors.has(j) ? "anchor (layer 0): stands for this chunk in the probe" : undefined}>
                  {prose(c.tokens, j)}
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

/** A chunk's text as prose: a single line break inside a paragraph (hard-wrapped source) reads
 * as a space; blank lines stay paragraph breaks. Only the display changes, not the tokens. */
function prose(tokens: string[], j: number): string {
  const t = tokens[j];
  if (!t.includes("\n") || t.includes("\n\n")) return t;
  const before = j > 0 && tokens[j - 1].endsWith("\n");
  const after = j + 1 < tokens.length && tokens[j + 1].startsWith("\n");
  return before || after ? t : t.replace("\n", " ");
}
