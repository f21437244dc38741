"""What the proxy costs: added latency (p50, p99) and the most non-streaming requests/s it sustains.

Starts, on loopback, two fake nodes (P and D) and the real proxy (``python -m proxy``) in
subprocesses, then measures
  1. latency of sequential non-stream requests straight to the fake D vs through the proxy
     (the proxy sends both legs, P and D, for each);
  2. requests/s through the proxy with N concurrent keep-alive connections for a few seconds.
The fakes and the load generator speak raw HTTP/1.1 over asyncio streams so that they cost
next to nothing and the numbers are the proxy's. Goals: <=1 ms added at p50, >=1,000 req/s.

    .venv/bin/python bench/proxy_overhead.py [--requests 500] [--concurrency 32] [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LENGTH = re.compile(rb"(?i)content-length:\s*(\d+)")
_ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "text": " world, how are you", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}}).encode()
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
             + str(len(_ANSWER)).encode() + b"\r\n\r\n" + _ANSWER)
_BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 16}).encode()


class _FakeNode(asyncio.Protocol):
    """Answers every request on a keep-alive connection with one fixed completion."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            match = _LENGTH.search(self.buf, 0, end)
            total = end + 4 + (int(match.group(1)) if match else 0)
            if len(self.buf) < total:
                return
            self.buf = self.buf[total:]
            self.transport.write(_RESPONSE)


async def _serve_fake(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_FakeNode, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class _Conn:
    """One keep-alive HTTP/1.1 connection issuing POSTs back to back."""

    def __init__(self, port: int, path: str):
        self.port = port
        self.request = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(_BODY)}\r\n\r\n").encode() + _BODY

    async def open(self) -> _Conn:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def call(self) -> None:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"bad answer: {head[:80]!r}")
        await self.reader.readexactly(int(_LENGTH.search(head).group(1)))

    def close(self) -> None:
        self.writer.close()


async def latencies(port: int, n: int) -> list[float]:
    conn = await _Conn(port, "/v1/completions").open()
    for _ in range(min(50, n)):  # warm up: pools filled, code paths hot
        await conn.call()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await conn.call()
        out.append(time.perf_counter() - start)
    conn.close()
    return out


async def throughput(port: int, concurrency: int, seconds: float) -> float:
    conns = [await _Conn(port, "/v1/completions").open() for _ in range(concurrency)]
    done = 0
    stop_at = time.perf_counter() + 0.5 + seconds
    measure_from = stop_at - seconds  # the first 0.5 s warms up

    async def worker(conn: _Conn) -> None:
        nonlocal done
        while (now := time.perf_counter()) < stop_at:
            await conn.call()
            if now >= measure_from:
                done += 1

    await asyncio.gather(*(worker(c) for c in conns))
    for c in conns:
        c.close()
    return done / seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(port: int, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered 200 on port {port}{path}")


def _cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process (Linux /proc); 0 elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q < 100 else max(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500, help="sequential requests per latency run")
    ap.add_argument("--concurrency", type=int, default=32, help="connections in the throughput run")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of the throughput run")
    ap.add_argument("--dispatch", default="concurrent", choices=["concurrent", "prefill_first"])
    ap.add_argument("--log-level", default="info", help="the proxy's log level (info logs every request)")
    ap.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)  # internal: be a fake node
    args = ap.parse_args()
    if args.serve_fake:
        asyncio.run(_serve_fake(args.serve_fake))
        return

    p_port, d_port, proxy_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "cwd": ROOT}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-fake", str(p)], **quiet) for p in (p_port, d_port)]
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "proxy", "--port", str(proxy_port), "--registry-port", "0",
         "--static-prefill", f"127.0.0.1:{p_port}@127.0.0.1:14579", "--static-decode",
         f"127.0.0.1:{d_port}@127.0.0.1:14580", "--dispatch", args.dispatch, "--log-level", args.log_level],
        **quiet))
    try:
        _wait_http(proxy_port, "/ready")
        direct = asyncio.run(latencies(d_port, args.requests))
        cpu_before = _cpu_s(procs[-1].pid)
        proxied = asyncio.run(latencies(proxy_port, args.requests))
        cpu_ms = (_cpu_s(procs[-1].pid) - cpu_before) * 1e3 / (args.requests + min(50, args.requests))
        direct_rps = asyncio.run(throughput(d_port, args.concurrency, args.seconds))
        proxy_rps = asyncio.run(throughput(proxy_port, args.concurrency, args.seconds))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
    _report(args, direct, proxied, direct_rps, proxy_rps, cpu_ms)


def _report(args, direct: list[float], proxied: list[float], direct_rps: float, proxy_rps: float,
            cpu_ms: float) -> None:
    ms = {name: (_pct(v, 50) * 1e3, _pct(v, 99) * 1e3) for name, v in (("direct", direct), ("proxy", proxied))}
    added50, added99 = ms["proxy"][0] - ms["direct"][0], ms["proxy"][1] - ms["direct"][1]
    print(f"proxy overhead ({os.cpu_count()} CPUs, dispatch={args.dispatch}, log-level={args.log_level}, "
          f"{args.requests} sequential requests, {args.concurrency} connections x {args.seconds:g} s)\n")
    print("| metric | direct to fake D | through proxy | added | goal | met |")
    print("|---|---|---|---|---|---|")
    print(f"| latency p50 (ms) | {ms['direct'][0]:.3f} | {ms['proxy'][0]:.3f} | {added50:.3f} | <= 1 ms added "
          f"| {'yes' if added50 <= 1.0 else 'no'} |")
    print(f"| latency p99 (ms) | {ms['direct'][1]:.3f} | {ms['proxy'][1]:.3f} | {added99:.3f} | - | - |")
    print(f"| non-stream requests/s | {direct_rps:,.0f} | {proxy_rps:,.0f} | - | >= 1,000 through proxy "
          f"| {'yes' if proxy_rps >= 1000 else 'no'} |")
    print(f"| proxy CPU per request (ms) | - | {cpu_ms:.3f} | - | - | - |")


if __name__ == "__main__":
    main()
