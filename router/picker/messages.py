"""The ext_proc answers the picker sends, built from plain values: the pick (headers, endpoint
metadata), the body replayed in chunks, a pass-through, an immediate (error) response.

The names and limits are the Gateway API Inference Extension's endpoint picker protocol: the
destination header and its `envoy.lb` metadata, body chunks of at most 62,000 bytes (under the
gRPC message limit Envoy gives a stream with its framing).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from google.protobuf.struct_pb2 import Struct

from router.picker.proto.base_pb2 import HeaderValue, HeaderValueOption
from router.picker.proto.external_processor_pb2 import (
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    TrailersResponse,
)
from router.picker.proto.http_status_pb2 import HttpStatus

DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
PREFILLER = "x-prefiller-host-port"
CHUNK = 62_000

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _set(headers: Sequence[tuple[str, bytes]]) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(header=HeaderValue(key=k, raw_value=v), append_action=_OVERWRITE)
            for k, v in headers
        ]
    )


def picked(
    endpoints: str, headers: Sequence[tuple[str, bytes]], remove: Sequence[str]
) -> ProcessingResponse:
    """The request headers' answer once picked: the destination (header and `envoy.lb`
    metadata, the same value), `headers` set, `remove` removed, the route recomputed."""
    mutation = _set([(DESTINATION, endpoints.encode()), *headers])
    mutation.remove_headers.extend(remove)
    metadata = Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = endpoints
    return ProcessingResponse(
        request_headers=HeadersResponse(
            response=CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


def replay(body: bytes, last: bool) -> Iterator[ProcessingResponse]:
    """The request body back to Envoy as streamed chunks of at most CHUNK bytes; `last`: the
    final one ends the stream (no trailers follow). An empty body is one empty chunk."""
    size = len(body)
    start = 0
    while True:
        end = min(start + CHUNK, size)
        out = ProcessingResponse()
        chunk = out.request_body.response.body_mutation.streamed_response
        chunk.body = body[start:end]
        chunk.end_of_stream = last and end == size
        yield out
        start = end
        if start >= size:
            return


def response_chunk(body: bytes, last: bool) -> ProcessingResponse:
    """A response body chunk passed on as it came. Built field by field: a fifth of the CPU of
    nesting messages as constructor arguments (each one copied into its parent), on the one
    path that runs per token."""
    out = ProcessingResponse()
    chunk = out.response_body.response.body_mutation.streamed_response
    chunk.body = body
    chunk.end_of_stream = last
    return out


def response_headers(headers: Sequence[tuple[str, bytes]] = ()) -> ProcessingResponse:
    """The response headers' answer: on as they came, with `headers` set."""
    if not headers:
        return RESPONSE_HEADERS
    common = CommonResponse(header_mutation=_set(headers))
    return ProcessingResponse(response_headers=HeadersResponse(response=common))


# The answers that carry nothing of their own: built once, never changed (gRPC only reads them).
RESPONSE_HEADERS = ProcessingResponse(response_headers=HeadersResponse(response=CommonResponse()))
REQUEST_TRAILERS = ProcessingResponse(request_trailers=TrailersResponse())
RESPONSE_TRAILERS = ProcessingResponse(response_trailers=TrailersResponse())


def immediate(
    status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes, details: str
) -> ProcessingResponse:
    """A local reply from the gateway: the picker's refusal, in the client's error format."""
    kept = [
        (k.decode("latin-1"), v)
        for k, v in headers
        if k.lower() not in (b"content-length", b"transfer-encoding")
    ]
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status),  # type: ignore[arg-type]
            headers=_set(kept),
            body=body,
            details=details,
        )
    )
