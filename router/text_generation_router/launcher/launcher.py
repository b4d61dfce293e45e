"""`text-generation-launcher`: download weights, start the shard, then the router; watch both.

Follows upstream's order (docs/tgi-interface.md §0, §3.2): download-weights must exit 0; the shard is ready
when its socket file exists; a child that exits makes the launcher stop the other one and
exit non-zero naming it; SIGINT/SIGTERM stop both process groups gracefully.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from text_generation_router.launcher.launcher_args import LauncherArgs, parse_args
from text_generation_router.layer_skip import LayerSkipMode

POLL_S = 0.1
TAIL_LINES = 40
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher() -> Callable[[], None] | None:
    """A preexec_fn making the kernel SIGTERM the child when the launcher dies, SIGKILL included.

    The children run in sessions of their own (so that a terminal's Ctrl-C reaches the launcher
    only, which then stops them in order); without this an orphaned shard would keep its memory
    and socket. libc is loaded before the fork: the child only makes the one call.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    launcher_pid = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher_pid:  # the launcher died before the call took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def log(level: str, text: str, json_output: bool = False) -> None:
    if json_output:
        print(json.dumps({"level": level, "target": "text_generation_launcher", "text": text}), flush=True)
    else:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {level:>5} text_generation_launcher: {text}", flush=True)


def executable(name: str) -> str:
    """Prefer the script installed next to this interpreter (the same virtualenv)."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"`{name}` is not installed (pip install -e server / -e router)")
    return found


class ShardLog:
    """Forwards a shard's loguru JSON lines and keeps its recent error output."""

    def __init__(self, name: str, json_output: bool) -> None:
        self.name = name
        self.json_output = json_output
        self.errors: deque[str] = deque(maxlen=TAIL_LINES)
        self.last_json: dict[str, object] | None = None

    def stdout_line(self, line: str) -> None:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            self.errors.append(line)
            return
        if not isinstance(record, dict):
            return
        self.last_json = record
        if "record" not in record:
            return
        level = str(record["record"].get("level", {}).get("name", "INFO"))
        text = str(record.get("text", "")).rstrip("\n")
        if level in ("ERROR", "CRITICAL"):
            self.errors.append(text)
        if self.json_output:
            print(line, flush=True)
        else:
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {level:>5} {self.name}: {text}", flush=True)

    def stderr_line(self, line: str) -> None:
        self.errors.append(line)

    def pump(self, proc: subprocess.Popen[str]) -> list[threading.Thread]:
        threads = []
        for stream, handle in ((proc.stdout, self.stdout_line), (proc.stderr, self.stderr_line)):
            def run(stream: object = stream, handle: object = handle) -> None:
                for raw in stream:  # type: ignore[attr-defined]
                    handle(raw.rstrip("\n"))  # type: ignore[operator]
            t = threading.Thread(target=run, daemon=True)
            t.start()
            threads.append(t)
        return threads


def child_env(args: LauncherArgs) -> dict[str, str]:
    """Launcher env minus LOG_LEVEL, plus what upstream gives every shard (docs/tgi-interface.md §3.2)."""
    env = {k: v for k, v in args.env.environ.items() if k != "LOG_LEVEL"}
    a = args.ns
    env.setdefault("ATTENTION", "flashdecoding-ipex")  # the block size of the shard's KV pools (64)
    env.setdefault("PREFIX_CACHING", "1")
    env.update({
        "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "SAFETENSORS_FAST_GPU": "1",
    })
    if "HF_API_TOKEN" in args.env.environ:
        env["HF_TOKEN"] = args.env.environ["HF_API_TOKEN"]
    if a.huggingface_hub_cache:
        env["HUGGINGFACE_HUB_CACHE"] = a.huggingface_hub_cache
    if a.max_total_tokens is not None:
        env["MAX_TOTAL_TOKENS"] = str(a.max_total_tokens)
    if a.max_batch_size is not None:
        env["MAX_BATCH_SIZE"] = str(a.max_batch_size)
    if a.enable_prefill_logprobs:
        env["REQUEST_LOGPROBS"] = "1"
    # Upstream's launcher hands the watermark strength to its shards this way.
    if a.watermark_gamma is not None:
        env["WATERMARK_GAMMA"] = str(a.watermark_gamma)
    if a.watermark_delta is not None:
        env["WATERMARK_DELTA"] = str(a.watermark_delta)
    return env


def download(args: LauncherArgs, env: dict[str, str]) -> str:
    """Run download-weights; returns the local folder it printed, or the model id."""
    a = args.ns
    argv = [executable("text-generation-server"), "download-weights", a.model_id,
            "--extension", ".safetensors", "--logger-level", "INFO", "--json-output"]
    if a.revision:
        argv += ["--revision", a.revision]
    if a.trust_remote_code:
        argv.append("--trust-remote-code")
    log("INFO", f"Starting download process: {' '.join(argv[1:])}", a.json_output)
    shard_log = ShardLog("download", a.json_output)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_launcher())
    threads = shard_log.pump(proc)
    code = proc.wait()
    for t in threads:
        t.join()
    if code != 0:
        tail = "\n".join(shard_log.errors)
        raise ChildFailed(f"Download encountered an error (exit code {code}):\n{tail}")
    log("INFO", "Successfully downloaded weights", a.json_output)
    local = (shard_log.last_json or {}).get("local_path")
    return str(local) if local else str(a.model_id)


class ChildFailed(RuntimeError):
    """A child process failed; the message names it."""


def shard_argv(args: LauncherArgs) -> list[str]:
    """Upstream's exact order (docs/tgi-interface.md §3.2 step 2), then this fork's extensions."""
    a = args.ns
    argv = [executable("text-generation-server"), "serve", a.model_id, "--uds-path",
            a.shard_uds_path, "--logger-level", "INFO", "--json-output"]
    if a.trust_remote_code:
        argv.append("--trust-remote-code")
    if a.quantize:
        argv += ["--quantize", a.quantize]
    if a.speculate is not None:  # upstream's place in the argv, after --quantize
        argv += ["--speculate", str(a.speculate)]
    if a.dtype:
        argv += ["--dtype", a.dtype]
    if a.revision:
        argv += ["--revision", a.revision]
    if a.otlp_endpoint:
        argv += ["--otlp-endpoint", a.otlp_endpoint]
    argv += ["--otlp-service-name", "text-generation-inference.server"]
    if args.max_input_tokens is not None:
        argv += ["--max-input-tokens", str(args.max_input_tokens)]
    argv += ["--runner", a.runner]
    if a.layer_skip_mode != LayerSkipMode.OFF:
        argv += ["--layer-skip-mode", a.layer_skip_mode]
    if a.layer_skip_policy:
        argv += ["--layer-skip-policy", a.layer_skip_policy]
    if a.layer_skip_on_bad_policy != "exit":
        argv += ["--layer-skip-on-bad-policy", a.layer_skip_on_bad_policy]
    argv += ["--grammar-compile-timeout", str(a.grammar_compile_timeout)]
    return argv


def router_argv(args: LauncherArgs, tokenizer_name: str) -> list[str]:
    """Spec §3.2 step 3."""
    a = args.ns
    argv = [executable("text-generation-router"),
            "--max-client-batch-size", str(a.max_client_batch_size),
            "--max-concurrent-requests", str(a.max_concurrent_requests),
            "--max-best-of", str(a.max_best_of), "--max-stop-sequences", str(a.max_stop_sequences),
            "--max-top-n-tokens", str(a.max_top_n_tokens),
            "--max-batch-prefill-tokens", str(args.max_batch_prefill_tokens()),
            "--waiting-served-ratio", str(a.waiting_served_ratio),
            "--max-waiting-tokens", str(a.max_waiting_tokens),
            "--validation-workers", str(a.validation_workers), "--hostname", a.hostname,
            "--port", str(a.port), "--prometheus-port", str(a.prometheus_port),
            "--master-shard-uds-path", f"{a.shard_uds_path}-0", "--tokenizer-name", tokenizer_name,
            "--payload-limit", str(a.payload_limit),
            "--graceful-termination-timeout", str(a.graceful_termination_timeout),
            "--served-model-name", a.served_model_name or a.model_id]
    optional = {"--max-input-tokens": args.max_input_tokens, "--max-total-tokens": a.max_total_tokens,
                "--max-batch-total-tokens": a.max_batch_total_tokens,
                "--max-batch-size": a.max_batch_size, "--api-key": a.api_key}
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    for origin in a.cors_allow_origin:
        argv += ["--cors-allow-origin", origin]
    for flag, on in (("--disable-grammar-support", a.disable_grammar_support),
                     ("--json-output", a.json_output), ("--trust-remote-code", a.trust_remote_code)):
        if on:
            argv.append(flag)
    return argv


def stop_group(proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the child's process group, SIGKILL after the graceful timeout."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class Supervisor:
    """Starts the shard and the router and watches them until one exits or a signal comes."""

    def __init__(self, args: LauncherArgs) -> None:
        self.args = args
        self.json_output: bool = args.ns.json_output
        self.stopping = threading.Event()
        self.shard: subprocess.Popen[str] | None = None
        self.router: subprocess.Popen[bytes] | None = None
        self.shard_log = ShardLog("shard-manager", self.json_output)

    def on_signal(self, signum: int, _: FrameType | None) -> None:
        log("INFO", f"Received {signal.Signals(signum).name}; shutting down", self.json_output)
        self.stopping.set()

    def start_shard(self, env: dict[str, str]) -> None:
        socket = Path(f"{self.args.ns.shard_uds_path}-0")
        socket.unlink(missing_ok=True)  # a stale socket would look ready at once
        argv = shard_argv(self.args)
        log("INFO", f"Starting shard 0: {' '.join(argv[1:])}", self.json_output)
        self.shard = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True, preexec_fn=die_with_launcher())
        self.shard_log.pump(self.shard)
        while not socket.exists():
            if self.shard.poll() is not None:
                raise ChildFailed(self.shard_crash_message())
            if self.stopping.wait(POLL_S):
                return
        log("INFO", "Shard 0 ready", self.json_output)

    def shard_crash_message(self) -> str:
        assert self.shard is not None
        code = self.shard.poll()
        time.sleep(0.2)  # let the reader threads collect the last lines
        tail = "\n".join(self.shard_log.errors)
        return f"Shard 0 crashed (exit code {code}):\n{tail}"

    def start_router(self, env: dict[str, str], tokenizer_name: str) -> None:
        argv = router_argv(self.args, tokenizer_name)
        shown = [x if x != self.args.ns.api_key else "***" for x in argv[1:]]
        log("INFO", f"Starting router: {' '.join(shown)}", self.json_output)
        env = {**env, "COMPUTE_TYPE": env.get("COMPUTE_TYPE", "1-cpu")}
        self.router = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_launcher())

    def watch(self) -> int:
        """Poll both children; returns the launcher's exit code."""
        assert self.shard is not None and self.router is not None
        while not self.stopping.wait(POLL_S):
            if self.shard.poll() is not None:
                log("ERROR", self.shard_crash_message(), self.json_output)
                return 1
            if self.router.poll() is not None:
                log("ERROR", f"Router exited (exit code {self.router.returncode})", self.json_output)
                return 1
        return 0

    def shutdown(self) -> None:
        timeout = float(self.args.ns.graceful_termination_timeout)
        for name, proc in (("router", self.router), ("shard 0", self.shard)):
            if proc is not None and proc.poll() is None:
                log("INFO", f"Terminating {name}", self.json_output)
                stop_group(proc, timeout)


def run(args: LauncherArgs) -> int:
    sup = Supervisor(args)
    signal.signal(signal.SIGINT, sup.on_signal)
    signal.signal(signal.SIGTERM, sup.on_signal)
    env = child_env(args)
    try:
        tokenizer_name = download(args, env)
        sup.start_shard(env)
        if sup.stopping.is_set():
            return 0
        sup.start_router(env, tokenizer_name)
        return sup.watch()
    except (ChildFailed, FileNotFoundError) as err:
        log("ERROR", str(err), sup.json_output)
        return 1
    finally:
        sup.shutdown()


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
