// Upload text/markdown files: chunk, embed, build the caches, with the job's progress.
import { useRef, useState } from "react";

import { api, followJob, type Job } from "./api";

interface Props {
  suffixes: string[];
  maxBytes: number;
  onIngested: (job: Job) => void;
}

export function Upload({ suffixes, maxBytes, onIngested }: Props) {
  const input = useRef<HTMLInputElement>(null);
  const [job, setJob] = useState<Job | null>(null);
  const [error, setError] = useState<string | null>(null);

  async function send(files: File[]) {
    if (!files.length) return;
    setError(null);
    try {
      const started = await api.ingest(files);
      setJob(started);
      const done = await followJob(started.id, setJob);
      if (done.state === "failed") setError(done.error ?? "ingestion failed");
      else onIngested(done);
    } catch (e) {
      setError((e as Error).message);
      setJob(null);
    } finally {
      if (input.current) input.current.value = "";
    }
  }

  const running = job !== null && (job.state === "queued" || job.state === "running");
  return (
    <div className="upload">
      <label className="button secondary">
        Add files…
        <input ref={input} type="file" multiple accept={suffixes.join(",")} data-testid="upload-input" disabled={running}
               onChange={(e) => send(Array.from(e.target.files ?? []))} hidden />
      </label>
      <span className="upload-status" data-testid="upload-status" data-state={error ? "failed" : job?.state ?? "idle"}>
        {error ? <span className="error-text">{error}</span>
          : running ? <Progress job={job!} />
          : job?.state === "done" ? `ingested ${job.result?.chunks ?? 0} chunk(s) from ${(job.result?.sources ?? []).join(", ")}`
          : <span className="muted">{suffixes.join(" ")} up to {(maxBytes / (1 << 20)).toFixed(1)} MiB</span>}
      </span>
    </div>
  );
}

function Progress({ job }: { job: Job }) {
  const share = job.total ? job.done / job.total : 0;
  return (
    <span className="progress">
      {job.stage || "queued"} {job.done}/{job.total}
      <span className="progress-track"><span style={{ width: `${100 * share}%` }} /></span>
    </span>
  );
}
