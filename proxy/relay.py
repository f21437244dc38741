"""Dispatch: one client request -> a prefill leg and a decode leg -> one answer.

A request's lifecycle here:
1. parse the body; the router picks a (P, D) pair; the disaggregation policy
   (proxy/disagg.py) decides where the prompt is prefilled; the id is tagged with both KV
   addresses (or ``local:0`` for P: the decode node prefills it) and sent as X-Request-Id.
2. start the legs: ``concurrent`` (both at once, the default) or ``prefill_first``
   (P to its end, then D: vLLM's order); a local prefill has only the decode leg. The leg that
   computes the prompt carries the peer hint when another node holds more of its prefix
   (``pdserve_peer_prefix``, proxy/exact_prefix.py); a client's own such field is removed.
3. wait until the answer can begin. P failed -> D is cancelled, and a P that failed as a node
   (unreachable, 503) is retried once on another P with a new id; with none left (or no P
   registered at all) the decode node computes the prompt itself. D failed -> P is cancelled,
   and a D that died runs it again elsewhere (a D that says its KV never came is not avoided);
   with every D gone, 503 ``no_node_available``. A node's 4xx is the request's fault: relayed,
   never retried. The client left -> both are cancelled.
4. relay: non-stream -> D's JSON as is; stream -> D's bytes chunk by chunk, never
   buffered. If P fails after streaming began, or D sends nothing for
   ``--stream-idle-timeout-s``, the client gets an SSE error event and [DONE] (the
   status line was already sent).
Cancelling a leg closes its connection; the daemons abort a request on disconnect.
Ids: the tag (both KV addresses + a uuid) goes only to the daemons; the client sees
``cmpl-<uuid>`` / ``chatcmpl-<uuid>`` (the daemons build the body's id from the tag's
uuid) and its own ``X-Request-Id`` echoed back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from common.cluster_auth import ClusterKey
from common.logging_setup import current_request_id
from common.registry_client import RegistrationMessage
from common.request_id import LOCAL_PREFILL, make_request_id
from common.serving.errors import body_error
from common.serving.limits import MAX_REQUEST_ID_CHARS
from common.serving.resume import RESUME_FIELD
from proxy.body import encode_body, is_text, off_loop, parse_body, with_field
from proxy.cache_salt import TenantSalt
from proxy.call import Call, Incoming, next_chunk, raise_if_failed, until, wait_disconnect
from proxy.config import ProxyConfig
from proxy.disagg import Decision, DisaggPolicy
from proxy.errors import (BadRequest, ClientDisconnected, NoNodeAvailable, ProxyError, RequestTimeout,
                          StreamIdle, UpstreamUnreachable, is_retryable)
from proxy.exact_prefix import PEER_PREFIX_FIELD, ExactPrefix, PromptTokens
from proxy.fair_share import client_of
from proxy.legs import Legs, prefill_body, read_chunks
from proxy.liveness import LostCheck, node_lost, watched
from proxy.metrics import ProxyMetrics, StreamWatch
from proxy.migration import Migration, StreamLedger
from proxy.routing import Pair, Router

logger = logging.getLogger(__name__)
_MAX_PREFILL_TRIES = 2  # prefill nodes that may fail one request before its decode node prefills it
_CLIENT_CLOSED = 499  # nginx's status for "client closed request": logged, never sent


class Dispatcher:
    """Runs requests; one per app, sharing the legs' pooled transport."""

    def __init__(self, legs: Legs, router: Router, config: ProxyConfig, metrics: ProxyMetrics,
                 exact: ExactPrefix | None = None):
        self.legs, self.router, self.config, self.metrics = legs, router, config, metrics
        self.disagg = DisaggPolicy(config.disagg_policy)
        self.disagg.exact = self.exact = exact
        self.disagg.in_flight = functools.partial(router.in_flight, "D")  # decodes running there, as of now
        # the prompt as routing reads it: its text, and its token ids when the KV events are indexed
        self.prompts = PromptTokens(config.tokenizer if exact is not None else None)
        self.tenant_salt = (TenantSalt(ClusterKey.optional(config.cluster_key_file))
                            if config.cache_salt_from_api_key else None)

    async def handle(self, request: Request, path: str) -> Response:
        incoming = Incoming(path, request.headers.get("x-request-id"), time.perf_counter())
        current_request_id.set(incoming.public_id)  # every line logged for this request carries it
        try:
            if incoming.client_id is not None and len(incoming.client_id) > MAX_REQUEST_ID_CHARS:
                incoming.client_id = None  # not echoed: it is what is wrong
                raise BadRequest(f"X-Request-Id is longer than {MAX_REQUEST_ID_CHARS} characters",
                                 param="X-Request-Id")
            body_bytes = await request.body()
            refused = body_error(request.headers.get("content-type"), body_bytes)  # as a node says it
            if refused is not None:
                raise BadRequest(refused.message, code=refused.code)
            body = await off_loop(len(body_bytes), parse_body, body_bytes)
            authorization = request.headers.get("authorization")
            if self.tenant_salt is not None:  # both legs and the prefix routing see the tenant's salt
                body = self.tenant_salt.apply(body, authorization)
                body_bytes = await off_loop(len(body_bytes), encode_body, body)
            client = client_of(authorization, body, self.config.api_key)  # for fair share in routing
        except ProxyError as exc:
            return self._failed(exc, incoming)
        watcher = asyncio.ensure_future(wait_disconnect(request))  # only after the body is read
        attempts: list[Call] = []
        try:
            async with asyncio.timeout(self.config.total_timeout_s):
                return await self._with_retry(body, body_bytes, incoming, watcher, attempts, client)
        except TimeoutError:
            exc = RequestTimeout(f"request exceeded {self.config.total_timeout_s:g} s")
            return self._failed(exc, incoming, attempts[-1] if attempts else None)
        except ProxyError as exc:
            return self._failed(exc, incoming, attempts[-1] if attempts else None)
        except ClientDisconnected:
            last = attempts[-1] if attempts else None
            self._finish(last, _CLIENT_CLOSED, incoming.start, "client went away", incoming)
            return Response(status_code=_CLIENT_CLOSED)
        finally:
            watcher.cancel()

    async def _with_retry(
        self, body: dict, body_bytes: bytes, incoming: Incoming, watcher: asyncio.Task, attempts: list[Call],
        client: str,
    ) -> Response:
        path = incoming.path
        if RESUME_FIELD in body or PEER_PREFIX_FIELD in body:  # internal: only this proxy may send them
            body = {k: v for k, v in body.items() if k not in (RESUME_FIELD, PEER_PREFIX_FIELD)}
            body_bytes = await off_loop(len(body_bytes), encode_body, body)
        migration = Migration(path, body, self.config.migration_limit)
        model = body.get("model") if is_text(body.get("model")) else None  # else the nodes refuse it
        p_bytes = await off_loop(len(body_bytes), prefill_body, body, path)
        stream = body.get("stream") is True
        prompt = await off_loop(len(body_bytes), self._prompt_of, body)
        rerun_of: ProxyError | None = None  # the decode failure being run again elsewhere
        while True:
            try:
                pair, decision = self._pick(model, prompt, migration.failed_prefills, migration.failed_decodes,
                                            client)
            except NoNodeAvailable as exc:
                if isinstance(rerun_of, UpstreamUnreachable) and not rerun_of.reached:  # every one it could use is gone
                    raise NoNodeAvailable(f"no live decode node: {rerun_of}; {exc}") from None
                if rerun_of is not None:  # no other decode node: the client gets the failure itself
                    raise rerun_of from None
                raise
            uid = uuid.uuid4().hex if attempts else incoming.uid
            p_addr = LOCAL_PREFILL if decision.local else pair.prefill.zmq_address
            tagged = make_request_id(p_addr, pair.decode.zmq_address, uid)
            call = Call(pair, tagged, incoming.id_prefix + uid, incoming.start, client_id=incoming.client_id,
                        decision=decision)
            attempts.append(call)
            self.router.begin(pair, decision.local)
            try:
                p_leg, d_leg = self._hinted(call, prompt, p_bytes, body_bytes)
                if not decision.local:
                    self._spawn_prefill(call, path, p_leg)
                if self.config.dispatch == "prefill_first" and call.prefill is not None:
                    await until(call.prefill, call, watcher)  # the leg watches its node itself
                if stream:
                    return await self._open_stream(call, path, d_leg, watcher, migration)
                return await self._run_full(call, path, d_leg, watcher)
            except ProxyError as exc:
                await self._close(call)
                if self._rerun(call, exc, migration):  # a stream too: its first byte had not gone out
                    rerun_of = exc
                    continue
                if decision.local or not is_retryable(exc):
                    raise
                migration.failed_prefills.add(pair.prefill.http_address)
                self.metrics.count_retry()
                logger.warning("request %s: prefill failed (%s), retrying on another prefill node or, with none "
                               "left, on the decode node", call.public_id, exc)
            except BaseException:
                await self._close(call)
                raise

    def _rerun(self, call: Call, exc: ProxyError, migration: Migration) -> bool:
        """An answer whose decode node died or stalled, or whose KV never came from its prefill node,
        before its first byte reached the client (a non-stream one, or a stream not yet begun) runs
        again without the node at fault (greedy and seeded requests give the same answer)."""
        if getattr(exc, "role", None) != "decode" or migration.count >= migration.limit:
            return False
        cause = migration.cause(exc, _prefill_of(call))
        if cause is None:
            return False
        migration.count += 1
        self.metrics.count_migration(cause)
        logger.warning("request %s: %s; running it again without the node at fault (%s, migration %d of %d)",
                       call.public_id, exc, cause, migration.count, migration.limit)
        return True

    def _pick(self, model: str | None, prompt: str, failed_prefills: set[str],
              failed_decodes: set[str], client: str) -> tuple[Pair, Decision]:
        """A pair and where its prompt is prefilled. Once a prefill node has failed the request and
        no other is left (or two have failed), or when no prefill node is registered at all, the
        decode node computes the prompt itself: a slower first token, not an error (counted as
        ``proxy_prefill_decisions_total{path="local",reason="prefill_failed"|"no_prefill_node"}``)."""
        if len(failed_prefills) < _MAX_PREFILL_TRIES:
            try:
                pair = self.router.pick(model, frozenset(failed_prefills), prompt, frozenset(failed_decodes), client)
                return pair, self._decide(pair, prompt)
            except NoNodeAvailable as exc:
                if not failed_prefills:
                    return self._decode_alone(model, prompt, failed_decodes, exc, client)
        pair = self.router.pick(model, frozenset(), prompt, frozenset(failed_decodes), client)
        decision = Decision("local", "prefill_failed")
        self.metrics.count_decision(decision.path, decision.reason)
        return pair, decision

    def _decode_alone(self, model: str | None, prompt: str, failed_decodes: set[str],
                      lack: NoNodeAvailable, client: str) -> tuple[Pair, Decision]:
        """With no prefill node registered at all (the last one was evicted), a decode node computes the
        prompt itself; ``lack`` (the router's NoNodeAvailable) is raised for anything else: no decode
        node either, or none compatible with the prefill nodes there are."""
        if self.router.registry.counts()["P"]:
            raise lack
        try:
            pair = self.router.pick_decode(model, prompt, frozenset(failed_decodes), client)
        except NoNodeAvailable:
            raise lack from None
        decision = Decision("local", "no_prefill_node")
        self.metrics.count_decision(decision.path, decision.reason)
        return pair, decision

    def _decide(self, pair: Pair, prompt: str) -> Decision:
        decision = self.disagg.decide(pair.prefill, pair.decode, prompt)
        self.disagg.sent(decision, pair.prefill, pair.decode, prompt)
        self.metrics.count_decision(decision.path, decision.reason)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("prefill %s (%s): est_local=%s est_remote=%s stall=%s P=%s D=%s", decision.path,
                         decision.reason, _ms(decision.est_local_s), _ms(decision.est_remote_s),
                         _ms(decision.stall_s), pair.prefill.http_address, pair.decode.http_address)
        return decision

    def _hinted(self, call: Call, prompt: str, p_bytes: bytes, d_bytes: bytes) -> tuple[bytes, bytes]:
        """The legs' bodies, the one whose node computes the prompt (P's; D's for a local prefill)
        with the peer hint when another node holds more of its prefix (proxy/exact_prefix.py)."""
        local = call.decision.local
        hint = self.exact.peer_hint(call.pair.decode if local else call.pair.prefill, prompt) if self.exact else None
        if hint is None:
            return p_bytes, d_bytes
        self.metrics.count_peer_hint()
        logger.debug("request %s: peer hint %s, %d blocks", call.public_id, hint.kv_addr, hint.blocks)
        if local:
            return p_bytes, with_field(d_bytes, PEER_PREFIX_FIELD, hint.field())
        return with_field(p_bytes, PEER_PREFIX_FIELD, hint.field()), d_bytes

    def _spawn_prefill(self, call: Call, path: str, p_bytes: bytes) -> None:
        # watched in either dispatch order: a stalled P must fail the leg, not wait out --prefill-timeout-s
        leg = self.legs.prefill(call.pair.prefill, path, p_bytes, call.request_id)
        call.prefill = call.spawn(watched(leg, self._lost("prefill", call.pair.prefill)))

    async def _run_full(self, call: Call, path: str, body_bytes: bytes, watcher: asyncio.Task) -> Response:
        call.decode = call.spawn(self.legs.decode_full(call.pair.decode, path, body_bytes, call.request_id))
        resp = await until(call.decode, call, watcher, self._lost("decode", call.pair.decode))
        await self._close(call)  # a prefill leg still open after D finished has nothing left to do
        self._finish(call, resp.status_code, call.start)
        headers = {"content-type": resp.headers.get("content-type", "application/json"),
                   "x-request-id": call.echo_id}
        return Response(resp.content, status_code=resp.status_code, headers=headers)

    async def _open_stream(self, call: Call, path: str, body_bytes: bytes, watcher: asyncio.Task,
                           migration: Migration) -> Response:
        first, chunks = await self._start_stream(call, path, body_bytes, watcher)
        headers = {"content-type": call.response.headers.get("content-type", "text/event-stream"),
                   "x-request-id": call.echo_id}
        return StreamingResponse(self._relay(call, first, chunks, migration), headers=headers)

    async def _start_stream(self, call: Call, path: str, body_bytes: bytes,
                            watcher: asyncio.Task | None) -> tuple[bytes, AsyncIterator[bytes]]:
        """Open the decode leg's stream and read its first bytes."""
        decode = call.pair.decode
        call.decode = call.spawn(self.legs.decode_open(decode, path, body_bytes, call.request_id))
        try:
            gone = self._lost("decode", decode)
            async with asyncio.timeout(self.config.first_token_timeout_s):
                try:  # a live node sends a stream's headers at once, before any compute: none is a stall
                    async with asyncio.timeout(self.config.stream_idle_timeout_s):
                        call.response = await until(call.decode, call, watcher, gone)
                except TimeoutError:
                    raise StreamIdle(decode.http_address, self.config.stream_idle_timeout_s) from None
                chunks = read_chunks(call.response, decode.http_address)
                first = await until(call.spawn(next_chunk(chunks)), call, watcher, gone)
        except TimeoutError as exc:
            raise RequestTimeout(f"decode node {decode.http_address} sent nothing within the first-token "
                                 f"timeout ({self.config.first_token_timeout_s:g} s)") from exc
        if first is None:
            raise UpstreamUnreachable("decode", decode.http_address, "stream ended before any data")
        return first, chunks

    async def _relay(self, call: Call, first: bytes, chunks: AsyncIterator[bytes],
                     migration: Migration) -> AsyncIterator[bytes]:
        status = _CLIENT_CLOSED  # stays so if the client's disconnect cancels us (unless [DONE] went out)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.total_timeout_s - (time.perf_counter() - call.start)
        idle_s = self.config.stream_idle_timeout_s
        watch = StreamWatch()
        detail = ""
        ledger = StreamLedger(call.pair.decode.http_address)  # what the client has: a migration resumes from it
        try:
            chunk: bytes | None = first
            while True:
                try:
                    while chunk is not None:
                        out = ledger.feed(chunk)
                        first_content = watch.feed(out)
                        if out:
                            yield out
                        if first_content:  # what a client's TTFT measures: content, not the role chunk
                            ttft = time.perf_counter() - call.start
                            self.metrics.observe_ttft(ttft)
                            self.disagg.observe_ttft(call.decision, call.pair.prefill, call.pair.decode, ttft)
                        # The deadlines wrap each read, never a yield: a timeout armed across a yield
                        # would fire inside Starlette's send, outside this generator.
                        idle_at = loop.time() + idle_s
                        try:
                            async with asyncio.timeout_at(min(deadline, idle_at)):
                                chunk = await self._next_relayed(call, chunks)
                        except TimeoutError:
                            if idle_at < deadline:
                                raise StreamIdle(call.pair.decode.http_address, idle_s) from None
                            raise
                    status = 200
                    break
                except ProxyError as exc:
                    if exc.role == "prefill" and ledger.token_ids:  # its KV has landed: nothing is lost
                        call.prefill, chunk = None, b""
                        call.reading = call.tasks[-1]  # the read of the decode stream it interrupted
                        continue
                    try:  # the decode node died or stalled: go on from another one
                        call, chunk, chunks = await self._migrate(call, exc, ledger, migration)
                    except ProxyError as final:
                        if ledger.finished:  # only [DONE] was missing: the answer is whole
                            status = 200
                            yield b"data: [DONE]\n\n"
                            break
                        raise final from None
        except TimeoutError:
            exc = RequestTimeout(f"request exceeded {self.config.total_timeout_s:g} s")
            status, detail = self._count_error(exc), str(exc)
            yield exc.sse_event()
        except ProxyError as exc:
            status, detail = self._count_error(exc), str(exc)
            yield exc.sse_event()
        finally:
            if status == _CLIENT_CLOSED and watch.done:
                status = 200  # the client left after [DONE]: the request completed
            await self._close(call)
            self._finish(call, status, call.start, detail)

    async def _migrate(self, call: Call, exc: ProxyError, ledger: StreamLedger,
                       migration: Migration) -> tuple[Call, bytes | None, AsyncIterator[bytes]]:
        """The stream resumed on another pair (proxy/migration.py); raises the error to report
        when it may not be, or no attempt within ``--migration-limit`` opened."""
        await self._close(call)
        while ledger.resumable and migration.count < migration.limit:
            cause = migration.cause(exc, _prefill_of(call))
            if cause is None:
                break
            body = migration.resume_body(ledger)
            if body is None:
                break
            migration.count += 1
            self.metrics.count_migration(cause)
            logger.warning("request %s: %s; resuming after %d tokens on another node (%s, migration %d of %d)",
                           call.public_id, exc, len(ledger.token_ids), cause, migration.count, migration.limit)
            try:
                resumed, prompt = self._resumed_call(call, migration, body)
            except ProxyError:
                break  # no other node: the client gets the first error
            try:
                p_leg, d_leg = self._hinted(resumed, prompt, prefill_body(body, migration.path), encode_body(body))
                if not resumed.decision.local:
                    self._spawn_prefill(resumed, migration.path, p_leg)
                first, chunks = await self._start_stream(resumed, migration.path, d_leg, None)
            except ProxyError as next_exc:
                await self._close(resumed)
                exc, call = next_exc, resumed
                continue
            except BaseException:
                await self._close(resumed)
                raise
            ledger.resume(resumed.pair.decode.http_address)
            return resumed, first, chunks
        raise exc

    def _prompt_of(self, body: dict) -> str:
        """The prompt as routing and the peer hint read it: its text when a policy reads prefixes, carrying
        its token ids while some followed node's events are fresh (only the peer fetchers are followed
        when no policy reads prefixes: proxy/app.py); "" when neither."""
        wants_text = self.config.policy == "prefix_aware" or self.config.disagg_policy == "auto"
        tokenize = self.exact is not None and self.exact.index.has_fresh
        return self.prompts.prompt(body, tokenize) if wants_text or tokenize else ""

    def _resumed_call(self, call: Call, migration: Migration, body: dict) -> tuple[Call, str]:
        """A new attempt for a migrated stream: a pair without the nodes that failed it, a new tag; and
        the client's prompt as routing read it (the computing leg's peer hint names its blocks)."""
        model = body.get("model") if is_text(body.get("model")) else None
        prompt = self._prompt_of(migration.body)
        skip_d, client = frozenset(migration.failed_decodes), call.pair.client
        try:
            pair = self.router.pick(model, frozenset(migration.failed_prefills), prompt, skip_d, client)
            decision = self._decide(pair, prompt)
        except NoNodeAvailable:
            if not migration.failed_prefills:
                raise
            pair = self.router.pick(model, frozenset(), prompt, skip_d, client)
            decision = Decision("local", "migration")  # no other prefill node: decode computes the prompt
        p_addr = LOCAL_PREFILL if decision.local else pair.prefill.zmq_address
        tagged = make_request_id(p_addr, pair.decode.zmq_address, uuid.uuid4().hex)
        resumed = Call(pair, tagged, call.public_id, call.start, client_id=call.client_id, decision=decision)
        self.router.begin(pair, decision.local)
        return resumed, prompt

    def _lost(self, role: str, node: RegistrationMessage) -> LostCheck:
        return node_lost(self.router.registry, role, node, self.config.node_stall_timeout_s)

    async def _next_relayed(self, call: Call, chunks: AsyncIterator[bytes]) -> bytes | None:
        if call.reading is not None:
            reading, call.reading = call.reading, None
            return await reading
        # While the prefill leg runs, its failure must interrupt the stream; after, read plainly.
        if call.prefill is not None and not call.prefill.done():
            return await until(call.spawn(next_chunk(chunks)), call, None)
        raise_if_failed(call.prefill)
        return await next_chunk(chunks)

    async def _close(self, call: Call) -> None:
        if call.closed:
            return
        call.closed = True
        self.router.end(call.pair, call.decision.local)
        await call.abort()

    def _failed(self, exc: ProxyError, incoming: Incoming, call: Call | None = None) -> Response:
        self._finish(call, self._count_error(exc), incoming.start, str(exc), incoming)
        return exc.response(call.echo_id if call is not None else incoming.client_id or incoming.public_id)

    def _count_error(self, exc: ProxyError) -> int:
        self.metrics.count_error(exc.kind)
        return exc.status

    def _finish(self, call: Call | None, status: int, start: float, detail: str = "",
                incoming: Incoming | None = None) -> None:
        """One log line per request: its ids, the nodes, the status, and what failed (naming the node)."""
        latency = time.perf_counter() - start
        self.metrics.observe_request(status, latency)
        level = logging.INFO if status < 500 else logging.WARNING
        if call is None:
            assert incoming is not None
            client = f" client_id={incoming.client_id}" if incoming.client_id else ""
            logger.log(level, "request %s%s status=%d latency=%.1fms %s", incoming.public_id, client, status,
                       latency * 1e3, detail)
            return
        client = f" client_id={call.client_id}" if call.client_id else ""
        prefill = "local" if call.decision.local else call.pair.prefill.http_address
        logger.log(level, "request %s%s tag=%s P=%s D=%s status=%d latency=%.1fms %s", call.public_id, client,
                   call.request_id, prefill, call.pair.decode.http_address, status,
                   latency * 1e3, detail)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}ms"


def _prefill_of(call: Call) -> str | None:
    return None if call.decision.local else call.pair.prefill.http_address
