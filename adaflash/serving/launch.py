"""The serving processes as `adaflash serve`, `adaflash gateway` and `adaflash fleet run` start them:
wire the parts together, serve in the foreground until stopped, and tear down in reverse order.

    serve        engine (+ step-loop watchdog) → feedback emitter → HTTP app → champion follower
    gateway      spooling feedback producer → proxy app in front of an OpenAI-compatible fleet
    fleet run    fleet controller + /healthz → champion follower that applies each promotion

The CLI only parses options and loads the target; everything a running server is made of is put
together here, so a reader finds one place per process. Imports stay inside the functions: the
gateway and the fleet controller never load torch's engine.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaflash.errors import InputError

Log = Callable[[str], None]


@dataclass
class ServeOptions:
    """How `serve` faces the world; the engine's own knobs are its `EngineConfig`."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "adaflash"  # the model id the API reports
    bootstrap_servers: str | None = None  # Kafka for feedback records; None: no feedback
    spool_dir: Path = Path(".adaflash/spool")  # feedback spool while Kafka is unreachable
    follow_registry: str | None = None  # MLflow URL: serve its champion, reload on every change
    admin_token: str | None = None  # None: the admin API (POST /admin/drafter/reload) is disabled
    step_loop: str = "thread"  # where the engine steps: see `STEP_LOOPS`


# Where `serve` steps its engine. torch's OpenMP runtime (libgomp) counts the main thread as one of
# its threads from the start, so a team started by any other thread makes more threads than cores
# on a 2-core machine, and libgomp then throttles its spin-wait: each op's worker sleeps and is
# woken. Measured on SmolLM2, AR, C = 1, 4 prompts x 64 tokens, 3 runs (benchmarks/http/README.md):
# quiet, 30-31 tok/s stepping on a thread against 45-49 on the main thread; beside one busy
# process, 30 on a thread against 11-13 on the main thread, whose spinning worker then fights the
# other job for a core. So `thread` (the default) for machines shared with other jobs (this one's
# demo and CI), `main` for dedicated cores.
STEP_LOOPS = ("thread", "main")


def check_step_loop(step_loop: str) -> None:
    if step_loop not in STEP_LOOPS:
        raise InputError(f"--step-loop {step_loop!r}: choose {' or '.join(STEP_LOOPS)}")


def exit_when_engine_dies(engine, log: Log) -> None:
    """A step loop that gave up (repeated failed steps) cannot recover in-process: exit non-zero so
    the supervisor (`adaflash up`, systemd, Kubernetes) restarts the server instead of leaving a
    process that answers /health 503 forever."""

    def watch() -> None:
        engine._thread.join()
        if engine.failure is not None:
            _exit_failed(engine, log)

    threading.Thread(target=watch, name="engine-watchdog", daemon=True).start()


def _exit_failed(engine, log: Log) -> None:
    log(f"error: the engine's step loop stopped: {engine.failure!r}; exiting")
    os._exit(70)  # EX_SOFTWARE


def step_in_foreground(engine, log: Log) -> None:
    """Run the engine's step loop on this thread until `engine.request_stop()`; a loop that gave
    up exits 70, as `exit_when_engine_dies` does for a loop on its own thread."""
    try:
        engine.run_here()
    except BaseException:
        if engine.failure is None:
            raise
        _exit_failed(engine, log)


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # a clean exit: whoever sent SIGTERM stopped us on purpose


def run_until_stopped(app, host: str, port: int, limits=None) -> None:
    """Serve `app` in the foreground until SIGINT or SIGTERM.

    uvicorn handles both by shutting down gracefully and then raising the signal again. SIGINT's
    default action raises KeyboardInterrupt, so the caller's `finally` (the feedback flush) runs;
    SIGTERM's ends the process on the spot and loses the last finished requests' feedback records
    (systemd, Kubernetes and `adaflash down` all send SIGTERM). So SIGTERM raises SystemExit
    here: the caller's cleanup runs exactly as for SIGINT, then the process exits 0."""
    import uvicorn

    from adaflash.serving.edge import EdgeLimits, uvicorn_config

    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        uvicorn.Server(uvicorn_config(app, host, port, limits or EdgeLimits())).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(target, bundle, drafter_dir: Path | None, engine_cfg, opts: ServeOptions, log: Log) -> None:
    """Run the OpenAI-compatible server on `target` (+ `bundle`, loaded from `drafter_dir`) until
    SIGINT or SIGTERM; either way every finished request's feedback record is flushed first."""
    from adaflash.serving.engine import Engine
    from adaflash.serving.reload import drafter_version
    from adaflash.serving.server import ServerSettings, create_app

    check_step_loop(opts.step_loop)
    engine = Engine(target, bundle, engine_cfg, drafter_version(bundle, drafter_dir) if bundle else None)
    emitter = None
    if opts.bootstrap_servers:
        from adaflash.feedback.producer import FeedbackProducer, ProducerConfig
        from adaflash.serving.feedback_emitter import FeedbackEmitter

        producer = FeedbackProducer(ProducerConfig(opts.bootstrap_servers, opts.spool_dir))
        emitter = FeedbackEmitter(engine, producer)
    app = create_app(
        engine,
        ServerSettings(model_name=opts.model_name, admin_token=opts.admin_token),
        feedback=emitter.producer if emitter is not None else None,
    )
    _serve_until_stopped(target, engine, emitter, app, engine_cfg, opts, log)


def _start_suffix_feed(target, engine, app, engine_cfg, opts: ServeOptions):
    if not (opts.bootstrap_servers and engine_cfg.suffix.enabled):
        return None
    from adaflash.serving.suffix_feed import CleanFeed

    # The fast learner reads the governed stream (never raw traffic): see suffix_feed.py.
    feed = CleanFeed(engine.suffix_cache, opts.bootstrap_servers, target.fingerprint)
    app.state.suffix_feed = feed.start(wait=0)
    return feed


def _follow_registry(target, app, opts: ServeOptions, log: Log):
    from adaflash.serving.champion_follower import ChampionFollower

    if not opts.bootstrap_servers:
        raise InputError("--follow-registry needs --bootstrap-servers (promotions arrive as Kafka events)")
    follower = ChampionFollower(
        app.state.reloader, opts.bootstrap_servers, opts.follow_registry, target.fingerprint
    )
    follower.start()  # subscribe first, so a promotion during the initial download is not missed
    live = follower.load_champion()
    log(f"following the champion at {opts.follow_registry}: " + (live or "none yet"))
    return follower


def _serving_line(target, engine, engine_cfg, opts: ServeOptions) -> str:
    return (
        f"serving {target.name} ({engine_cfg.method}, drafter {engine.drafter_version}) on "
        f"http://{opts.host}:{opts.port}"
        + ("" if opts.admin_token else " — admin API disabled (set ADAFLASH_ADMIN_TOKEN)")
        + (", stepping on the main thread" if opts.step_loop == "main" else "")
    )


def _serve_until_stopped(target, engine, emitter, app, engine_cfg, opts: ServeOptions, log: Log) -> None:
    """Step the engine and serve HTTP until SIGINT or SIGTERM, then tear down in reverse order.
    `--step-loop thread`: the engine on its own thread, uvicorn in the foreground; `main`: uvicorn
    on a thread of its own and the engine stepped here (`STEP_LOOPS`), where the champion's first
    load is staged before the loop runs and applied at its first step."""
    http = (
        HttpThread(app, opts.host, opts.port, app.state.settings.edge, engine)
        if opts.step_loop == "main"
        else None
    )
    if http is None:
        engine.start()
        exit_when_engine_dies(engine, log)
    feed = _start_suffix_feed(target, engine, app, engine_cfg, opts)
    follower = None
    try:
        if opts.follow_registry:
            follower = _follow_registry(target, app, opts, log)
        log(_serving_line(target, engine, engine_cfg, opts))
        if http is None:
            run_until_stopped(app, opts.host, opts.port, app.state.settings.edge)
        else:
            http.start()
            step_in_foreground(engine, log)
            http.raise_if_failed()
    finally:
        if http is not None:
            http.stop()
        if feed is not None:
            feed.stop()
        if follower is not None:
            follower.stop()
        engine.stop()
        if emitter is not None:
            emitter.close()


class HttpThread:
    """uvicorn on a thread of its own while the main thread steps the engine (`serve --step-loop main`).

    SIGINT and SIGTERM (systemd, Kubernetes and `adaflash down` send SIGTERM) start uvicorn's
    graceful shutdown: no new connections, in-flight answers finish (the step loop still runs
    them), and only then is the step loop asked to end, so that `serve`'s cleanup (the feedback
    flush) runs and the process exits 0. A second SIGINT forces uvicorn to stop at once."""

    def __init__(self, app, host: str, port: int, limits, engine) -> None:
        import uvicorn

        from adaflash.serving.edge import uvicorn_config

        self.where = f"{host}:{port}"
        self.server = uvicorn.Server(uvicorn_config(app, host, port, limits))
        self.engine = engine
        self.signalled = False
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self._previous: dict[int, object] = {}

    def _run(self) -> None:
        try:
            self.server.run()  # off the main thread uvicorn installs no signal handlers
        finally:
            self.engine.request_stop()  # uvicorn has drained (or never started): end the step loop

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True
        self.server.handle_exit(signum, frame)

    def start(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._thread.start()

    def raise_if_failed(self) -> None:
        if not self.server.started and not self.signalled:
            raise InputError(f"the HTTP server could not start on {self.where} (see the log above)")

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(30)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def read_api_keys(path: Path) -> dict[str, str]:
    """The gateway's `{api_key: tenant_id}` file; a one-line InputError when it is not one."""
    try:
        keys = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read API keys from {path}: {e}") from None
    if not isinstance(keys, dict) or not keys:
        raise InputError(f"{path} must hold a non-empty JSON object {{api_key: tenant_id}}")
    return keys


def gateway(settings, target: str, bootstrap_servers: str, spool_dir: Path, host: str, port: int,
            log: Log) -> None:  # fmt: skip
    """Proxy `settings.upstream` on host:port, one feedback record per finished request."""
    from adaflash.feedback.producer import FeedbackProducer, ProducerConfig
    from adaflash.models.targets import load_vocabulary
    from adaflash.serving.gateway import create_gateway

    producer = FeedbackProducer(ProducerConfig(bootstrap_servers, spool_dir))
    app = create_gateway(settings, load_vocabulary(target), producer.send)
    log(f"gateway for {settings.upstream} on http://{host}:{port} ({len(settings.api_keys)} API keys)")
    try:
        run_until_stopped(app, host, port)
    finally:
        producer.close()


def fleet_controller(config: Path, health_port: int, log: Log, extra: tuple = ()) -> None:
    """Follow adaflash.drafter.events and make every champion change live on the fleet, forever.
    `extra`: backends beside the config's (`fleet run --engine vllm`)."""
    import time

    from adaflash.models.targets import load_vocabulary
    from adaflash.serving.champion_follower import ChampionFollower
    from adaflash.serving.fleet import FleetConfig, FleetController, serve_health

    cfg = FleetConfig.load(config)
    cfg.backends += list(extra)
    fingerprint = load_vocabulary(cfg.target).fingerprint
    controller = FleetController(cfg, fingerprint)
    serve_health(health_port, controller)
    follower = ChampionFollower(
        None, cfg.bootstrap_servers, cfg.tracking_uri, fingerprint, apply=controller.apply
    )
    follower.start()
    log(f"fleet controller: {len(cfg.backends)} backend(s), health on :{health_port}")
    try:
        while True:
            time.sleep(3600)
    finally:
        follower.stop()
        controller.close()
