// Number formatting shared by the page. TTFTs are shown with one decimal, as toFixed gives it.

export const ms = (x: number): string => `${x.toFixed(1)} ms`;

export function bytes(n: number): string {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
}

export const pct = (x: number): string => `${(100 * x).toFixed(1)}%`;

/** Orange (recomputed at every layer) to green (recomputed at the first layers only). */
export function depthColour(depth: number, layers: number): string {
  const f = layers > 1 ? (depth - 1) / (layers - 1) : 1; // 0: one layer, 1: all of them
  const hue = 140 - 115 * Math.max(0, Math.min(1, f)); // 140 green -> 25 orange
  return `hsl(${hue.toFixed(0)} 85% 58%)`;
}

export const TIER_NAMES: Record<string, string> = {
  gpu: "GPU tier",
  host: "host memory tier",
  disk: "disk tier",
  tensor: "in memory (prefix, fresh builds)",
};
