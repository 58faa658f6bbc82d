"""`morpho-rpc`: an Ethereum JSON-RPC gateway that answers state reads by private lookups.

A wallet points its RPC URL here. eth_getBalance, eth_getTransactionCount, eth_getCode and
eth_getStorageAt are answered by lookups in the state table both parties serve
(docs/PROTOCOL.md section 9.5), each request making the same traffic whatever the address;
eth_chainId, eth_blockNumber (the epoch's block), net_version and web3_clientVersion locally;
any other method goes to --upstream where one is given, else -32601. Reads are never sent
upstream, even when the parties are down: that would show the address to the upstream.
"""
from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, Sequence

import httpx

from morpho_pir.ethereum import (
    ACCOUNT_TYPE, CODE_CHUNK_BYTES, CODE_TYPE, EMPTY_CODE_HASH, MAX_CODE_CHUNKS,
    STORAGE_TYPE, WORD_BYTES, Account, code_key, state_key, storage_key,
)

from morpho_client.core import PirError
from morpho_client.sync import PirClient

VERSION = "morpho-rpc/0.1.0"
PRIVATE = ("eth_getBalance", "eth_getTransactionCount", "eth_getCode", "eth_getStorageAt")
TAGS = ("latest", "pending", "safe", "finalized")
MAX_BODY_BYTES = 1 << 20


class RpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def quantity(value: int) -> str:
    """Ethereum's compact hex: 0x0, 0x1a, never leading zeros."""
    return hex(value)


def parse_address(value) -> bytes:
    if not isinstance(value, str) or not value[:2] in ("0x", "0X") or len(value) != 42:
        raise RpcError(-32602, f"invalid address {value!r:.60}: expected 0x and 40 hex digits")
    try:
        return bytes.fromhex(value[2:])
    except ValueError:
        raise RpcError(-32602, f"invalid address {value!r:.60}: not hex") from None


def parse_quantity(value, what: str, limit_bytes: int = WORD_BYTES) -> int:
    if not isinstance(value, str) or value[:2] not in ("0x", "0X") or len(value) < 3:
        raise RpcError(-32602, f"invalid {what} {value!r:.80}: expected a 0x hex quantity")
    try:
        number = int(value[2:], 16)
    except ValueError:
        raise RpcError(-32602, f"invalid {what} {value!r:.80}: not hex") from None
    if number >= 1 << (8 * limit_bytes):
        raise RpcError(-32602, f"invalid {what} {value!r:.80}: more than {limit_bytes} bytes")
    return number


def check_block(value, served_block: int) -> None:
    """The block parameter: omitted, a tag, the epoch's number or an EIP-1898 object for it."""
    if value is None or value in TAGS:
        return
    if isinstance(value, dict):
        if "blockHash" in value:
            raise RpcError(-32000, "header not found: this gateway serves blocks by number only "
                                   f"(block {served_block})")
        if set(value) - {"blockNumber", "requireCanonical"} or "blockNumber" not in value:
            raise RpcError(-32602, f"invalid block parameter {value!r:.80}")
        value = value["blockNumber"]
        if value in TAGS:
            return
    if value == "earliest":
        number = 0
    else:
        number = parse_quantity(value, "block number", 8)
    if number != served_block:
        raise RpcError(-32000, f"header not found: block {number} is not served here; the "
                               f"parties serve the state of block {served_block}")


class Gateway:
    """Answers JSON-RPC requests; private reads through `client`, the rest as the module says."""

    def __init__(self, client: PirClient, upstream: Optional[str] = None,
                 chain_id: int = 1) -> None:
        self.client = client
        self.upstream = upstream
        self.chain_id = chain_id
        self._http = httpx.Client(timeout=60.0) if upstream else None

    # -- the batch, its private reads gathered --------------------------------------------------
    def handle(self, body):
        """A parsed JSON-RPC body (one request or a batch) -> the response body (or None)."""
        if isinstance(body, list):
            if not body:
                return error_response(None, -32600, "invalid request: an empty batch")
            answers = self.answer_all(body)
            answers = [a for a in answers if a is not None]
            return answers or None
        return self.answer_all([body])[0]

    def answer_all(self, requests: list) -> list:
        answers: list = [None] * len(requests)
        reads = []  # (index, request id, method, params) of the private reads
        for index, request in enumerate(requests):
            if not isinstance(request, dict) or request.get("jsonrpc") != "2.0" or \
                    not isinstance(request.get("method"), str):
                answers[index] = error_response(request.get("id") if isinstance(request, dict)
                                                else None, -32600, "invalid request")
                continue
            rid, method, params = request.get("id"), request["method"], request.get("params", [])
            if not isinstance(params, list):
                answers[index] = error_response(rid, -32602, "params: expected an array")
                continue
            try:
                if method in PRIVATE:
                    reads.append((index, rid, method, params))
                    continue
                answers[index] = result_response(rid, self.local(method, params, request))
            except RpcError as exc:
                answers[index] = error_response(rid, exc.code, str(exc))
        if reads:
            for (index, rid, _, _), answer in zip(reads, self.private_reads(reads)):
                answers[index] = answer
        return [a if requests[i] is None or not isinstance(requests[i], dict)
                or "id" in requests[i] else None for i, a in enumerate(answers)]

    def local(self, method: str, params: list, request: dict):
        if method == "eth_chainId":
            return quantity(self.chain_id)
        if method == "net_version":
            return str(self.chain_id)
        if method == "web3_clientVersion":
            return VERSION
        if method == "eth_blockNumber":
            return quantity(self.served_block())
        if self._http is None:
            raise RpcError(-32601, f"the method {method} does not exist/is not available "
                                   f"(this gateway answers {', '.join(PRIVATE)} privately and "
                                   f"has no --upstream for the rest)")
        return self.forward(request)

    def forward(self, request: dict):
        try:
            reply = self._http.post(self.upstream, json=request).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RpcError(-32000, f"upstream {self.upstream}: {exc}") from None
        if isinstance(reply, dict) and "error" in reply:
            error = reply["error"] or {}
            raise RpcError(int(error.get("code", -32000)), str(error.get("message", "")))
        return reply.get("result") if isinstance(reply, dict) else None

    def served_block(self) -> int:
        try:
            return self.client.epoch().block_number
        except PirError as exc:
            raise RpcError(-32000, f"the PIR parties cannot say their block: {exc}") from None

    # -- private reads ----------------------------------------------------------------------------
    def private_reads(self, reads: list) -> list:
        """The responses of the batch's private reads: its accounts and slots in one lookup,
        then the code of every eth_getCode (128 chunks each, whatever the code's size)."""
        try:
            block = self.served_block()
        except RpcError as exc:
            return [error_response(rid, exc.code, str(exc)) for _, rid, _, _ in reads]
        keys, parsed = [], []
        for _, rid, method, params in reads:
            try:
                if method == "eth_getStorageAt":
                    if not 2 <= len(params) <= 3:
                        raise RpcError(-32602, f"{method}: expected [address, slot, block]")
                    address = parse_address(params[0])
                    slot = parse_quantity(params[1], "storage slot").to_bytes(WORD_BYTES, "big")
                    check_block(params[2] if len(params) > 2 else None, block)
                    key = state_key(STORAGE_TYPE, storage_key(address, slot))
                else:
                    if not 1 <= len(params) <= 2:
                        raise RpcError(-32602, f"{method}: expected [address, block]")
                    address = parse_address(params[0])
                    check_block(params[1] if len(params) > 1 else None, block)
                    key = state_key(ACCOUNT_TYPE, address)
                parsed.append(len(keys))
                keys.append(key)
            except RpcError as exc:
                parsed.append(exc)
        try:
            values = self.client.lookup_many(keys) if keys else []
            codes = self.codes([values[at] for at, (_, _, method, _) in zip(parsed, reads)
                                if method == "eth_getCode" and not isinstance(at, RpcError)])
        except (PirError, ValueError) as exc:
            failure = RpcError(-32000, f"private lookup failed: {exc}")
            return [error_response(rid, failure.code, str(failure)) for _, rid, _, _ in reads]
        answers = []
        for at, (_, rid, method, _) in zip(parsed, reads):
            if isinstance(at, RpcError):
                answers.append(error_response(rid, at.code, str(at)))
                continue
            answers.append(result_response(rid, self.result(method, values[at], codes)))
        return answers

    def result(self, method: str, value: Optional[bytes], codes: list):
        if method == "eth_getStorageAt":
            return "0x" + (value[:WORD_BYTES] if value else bytes(WORD_BYTES)).hex()
        account = Account.decode(value[:76]) if value else Account(0, 0)
        if method == "eth_getBalance":
            return quantity(account.balance)
        if method == "eth_getTransactionCount":
            return quantity(account.nonce)
        return "0x" + codes.pop(0).hex()

    def codes(self, accounts: list) -> list:
        """Each account's code: its 128 chunk keys looked up (absent past the code's end)."""
        if not accounts:
            return []
        decoded = [Account.decode(v[:76]) if v else Account(0, 0) for v in accounts]
        keys = [state_key(CODE_TYPE, code_key(a.code_hash or EMPTY_CODE_HASH, chunk))
                for a in decoded for chunk in range(MAX_CODE_CHUNKS)]
        chunks = self.client.lookup_many(keys)
        out = []
        for index, account in enumerate(decoded):
            mine = chunks[index * MAX_CODE_CHUNKS:(index + 1) * MAX_CODE_CHUNKS]
            needed = -(-account.code_size // CODE_CHUNK_BYTES)
            if any(chunk is None for chunk in mine[:needed]):
                raise PirError(f"the code of hash 0x{account.code_hash.hex()} is missing chunks")
            out.append(b"".join(mine[:needed])[:account.code_size])
        return out


def result_response(rid, result) -> dict:
    return {"jsonrpc": "2.0", "id": rid, "result": result}


def error_response(rid, code: int, message: str) -> dict:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}


def make_server(gateway: Gateway, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                return self.reply(400, error_response(None, -32600, "invalid Content-Length"))
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                return self.reply(200, error_response(None, -32700, "parse error"))
            answer = gateway.handle(body)
            self.reply(200, answer)

        def reply(self, status: int, body) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass  # the addresses asked for are not written anywhere

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="morpho-rpc", description=__doc__.split("\n\n")[1])
    parser.add_argument("--server-a", required=True, help="base URL of PIR party A")
    parser.add_argument("--server-b", required=True, help="base URL of PIR party B")
    parser.add_argument("--upstream", help="an Ethereum JSON-RPC URL for every other method "
                                           "(never for the four private reads)")
    parser.add_argument("--listen", default="127.0.0.1:8545", help="host:port (default "
                                                                    "127.0.0.1:8545)")
    parser.add_argument("--chain-id", type=int, default=1, help="eth_chainId (default 1)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per PIR request")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    try:
        port_number = int(port)
    except ValueError:
        parser.error(f"--listen: expected host:port, got {args.listen!r}")
    with PirClient(args.server_a, args.server_b, timeout=args.timeout) as client:
        server = make_server(Gateway(client, args.upstream, args.chain_id), host or "127.0.0.1",
                             port_number)
        print(f"morpho-rpc listening on http://{args.listen} (parties {args.server_a}, "
              f"{args.server_b})", file=sys.stderr, flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
