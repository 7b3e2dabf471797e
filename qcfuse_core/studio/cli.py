"""`qcfuse studio`: open the store (the sample corpus when it is empty), serve the page.

    qcfuse studio [--store DIR] [--model NAME|DIR ...] [--port 8501]

The server binds to 127.0.0.1 only; the page and its fonts are files inside the package,
so nothing is fetched from anywhere.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

DEFAULT_PORT = 8501
BACKLOG = 2048  # uvicorn's default


def add_commands(sub) -> None:
    from qcfuse_core.cli.flags import above, port
    from qcfuse_core.paths import cache_dir

    p = sub.add_parser("studio", help="a local web page that shows what fusion did (needs qcfuse[studio])")
    p.add_argument(
        "--store",
        type=Path,
        default=cache_dir() / "store",
        help="store folder (Chroma + chunk caches); an empty one gets the sample corpus (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME|DIR",
        help="model to load first: a packaged model (smollm2-135m, gemma3-270m) or a local HF model "
        "folder, which is then offered too (repeatable; the first is loaded; default: the embedded "
        "SmolLM2-135M-Instruct). Every installed packaged model is in the page's model menu",
    )
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="model dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda")
    p.add_argument(
        "--port", type=port, default=DEFAULT_PORT, help="port on 127.0.0.1 (default: %(default)s; 0: any free one)"
    )
    p.add_argument(
        "--max-upload-mb", type=above(0), default=1.0, help="largest file the page may upload (default: %(default)s)"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up answers before serving")
    p.set_defaults(func=cmd_studio)


def cmd_studio(args) -> int:
    from qcfuse_core.studio import require_extra

    require_extra()  # the flags were checked as they were parsed (cli/flags.py)
    import uvicorn
    from tqdm import tqdm

    from qcfuse_core.studio.app import create_app
    from qcfuse_core.studio.service import StudioConfig, StudioService

    cfg = StudioConfig(
        store=args.store,
        models=tuple(args.model),
        dtype=args.dtype,
        device=args.device,
        max_upload_bytes=int(args.max_upload_mb * (1 << 20)),
    )
    from qcfuse_core.studio.models import conversion_state, initial_model, installed_models

    models = installed_models(cfg.models)
    if not models:
        raise ImportError("no model to load: install the embedded one (make setup) or pass --model DIR")
    first = initial_model(models, cfg.models)
    state = conversion_state(first)
    if state is not None and not state[1]:
        print(
            f"qcfuse studio: converting {first.name} from its GGUF into {state[0].parent} (first time only; "
            "minutes on a small CPU)",
            flush=True,
        )
    print(f"qcfuse studio: loading {first.name} and opening {args.store}", flush=True)
    service = StudioService(cfg)
    bars: dict[str, tqdm] = {}

    def progress(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            for other in bars.values():  # one bar at a time: the previous stage is over
                other.close()
            bar = bars[stage] = tqdm(total=total, desc=f"sample corpus: {stage}", unit="chunk", file=sys.stdout)
        bar.n = done
        bar.refresh()

    got = service.ensure_corpus(progress)
    for bar in bars.values():
        bar.close()
    if got is not None:
        print(f"the store was empty: ingested the sample corpus ({got['chunks']} chunks)", flush=True)
    if not args.no_warmup:
        service.warm_up()
    app = create_app(service)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", args.port))
    except OSError as e:
        raise ValueError(f"cannot listen on 127.0.0.1:{args.port} ({e.strerror}); pick another --port") from None
    sock.listen(BACKLOG)  # from here on connections wait in the backlog until the server takes them
    port = sock.getsockname()[1]
    st = service.status()
    print(
        f"QCFuse Studio on http://127.0.0.1:{port}  ({st['model']['name']}, {st['chunks']} chunks in "
        f"{st['store']}; Ctrl-C stops it)",
        flush=True,
    )
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0
