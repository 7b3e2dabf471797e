// The store's tiers (GET /api/store): what each holds, how full it is, and how often it was hit.
import { useEffect, useState } from "react";
import { api, type StoreTiers } from "./api";
import { bytes, pct, TIER_NAMES } from "./format";

/** Fetched when the page opens and again whenever `tick` changes (after a run or an upload). */
export function Tiers({ tick }: { tick: number }) {
  const [store, setStore] = useState<StoreTiers | null>(null);
  useEffect(() => {
    api.store().then(setStore, () => setStore(null));
  }, [tick]);
  const tiers = Object.entries(store?.tiers ?? {});
  if (!tiers.length) return null;
  const num = (x: number | null) => (x === null ? "–" : String(x));
  return (
    <section className="history" data-testid="tiers">
      <h2>Chunk cache tiers <span className="muted">(since the studio started)</span></h2>
      <div className="table-wrap">
        <table className="history-table" data-testid="tiers-table">
          <thead>
            <tr>
              <th>tier</th><th>entries</th><th>used / capacity</th><th>occupancy</th>
              <th>hits</th><th>misses</th><th title="hits / (hits + misses)">hit rate</th><th>evictions</th>
            </tr>
          </thead>
          <tbody>
            {tiers.map(([name, t]) => (
              <tr key={name} data-testid="tier-row" data-tier={name}>
                <td>{TIER_NAMES[name] ?? name}</td>
                <td className="num">{num(t.entries)}</td>
                <td className="num">{bytes(t.bytes_used)} / {t.capacity_bytes === null ? "unbounded" : bytes(t.capacity_bytes)}</td>
                <td className="num" data-testid="tier-occupancy">{t.occupancy === null ? "–" : pct(t.occupancy)}</td>
                <td className="num">{num(t.hits)}</td>
                <td className="num">{num(t.misses)}</td>
                <td className="num" data-testid="tier-hit-rate">{t.hit_rate === null ? "–" : pct(t.hit_rate)}</td>
                <td className="num">{num(t.evictions)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      </div>
      <p className="muted small">
        Hits and misses are lookups in each tier; the disk tier counts each layer it reads. Memory tiers hold the
        chunks used most; the rest are read from disk.
      </p>
    </section>
  );
}
