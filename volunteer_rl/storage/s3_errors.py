"""What S3's answers mean: the HTTP status and error code of a botocore ClientError, whether
botocore had retried the request, a condition that did not hold, and which faults are worth
another try (`is_transient`, also the rule for s3:// through s3fs: fsspec.py). Shared by the
S3 backend (s3.py) and its transfers (s3_transfer.py); botocore is imported only inside
is_transient, so importing this stays instant. How much of an error answer is read at all is
`bound_error_bodies`, set on every client S3Storage makes.
"""

from __future__ import annotations

from volunteer_rl.storage.base import is_transient_os_error


def http_status(exc) -> int:
    """HTTP status of a botocore ClientError (0 if unknown)."""
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)


def error_code(exc) -> str:
    """S3 error code of a botocore ClientError ('NoSuchKey', 'PreconditionFailed', ...)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def was_retried(exc) -> bool:
    """True if botocore retried the request that failed: an earlier attempt may have landed."""
    return exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0


RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                         "TooManyRequests", "RequestTimeout", "InternalError",
                         "ServiceUnavailable"})
"""S3 error codes of answers worth another try whatever their HTTP status."""


def is_transient(exc: BaseException) -> bool:
    """Is this a fault worth another try? A ClientError with a 5xx or 429 status or one of
    RETRY_CODES; botocore's and urllib3's connection errors and timeouts (not a failed TLS
    handshake, which a retry repeats); a body cut short; a socket's own timeout or reset.
    botocore has spent its own retries on these before they reach us; Retrying spaces out a
    few more. Also the rule for s3:// through s3fs (storage/fsspec.py)."""
    import http.client

    from botocore import exceptions as boto
    from urllib3 import exceptions as urllib3

    if isinstance(exc, boto.ClientError):
        status = http_status(exc)
        return status >= 500 or status == 429 or error_code(exc) in RETRY_CODES
    if isinstance(exc, boto.SSLError):
        return False
    return is_transient_os_error(exc) or isinstance(exc, (
        boto.ConnectionError, boto.HTTPClientError, boto.IncompleteReadError,
        urllib3.ProtocolError, urllib3.TimeoutError, http.client.IncompleteRead))


def is_conflict(exc) -> bool:
    """A condition did not hold: 412, or 409 when another conditional write was in flight."""
    return http_status(exc) == 412 or error_code(exc) == "ConditionalRequestConflict"



ERROR_BODY_BYTES = 64 * 1024
"""Bytes of an answer's body read at most when its status is 300 or more (an error, a 304):
S3's error document is a few hundred bytes. The rest of a longer one is never read (the
connection is dropped), and botocore parses what was read, or, if that is not XML, makes the
error from the status alone; each try of a request costs at most this."""


def bound_error_bodies(client) -> None:
    """Make every request of a boto3 client read at most ERROR_BODY_BYTES of an answer whose
    status is 300 or more. botocore reads such a body whole, for any operation (`content`),
    before it parses it or decides to retry: an endpoint answering 500 with an endless
    body would be read without end, on every try. So the client's HTTP session is asked to
    leave every body unread, and its answer is read here: an error's up to the bound, any
    other whole when botocore would have (operations without a streamed output)."""
    session = client._endpoint.http_session
    send = session.send

    def bounded_send(request):
        streamed = request.stream_output
        request.stream_output = True
        try:
            response = send(request)
        finally:
            request.stream_output = streamed
        if response.status_code >= 300:
            response._content = _head(response.raw, ERROR_BODY_BYTES)
        elif not streamed:
            response.content  # noqa: B018 - read whole now, as botocore's session does
        return response

    session.send = bounded_send


def _head(raw, cap: int) -> bytes:
    """At most `cap` bytes of an answer's body (a urllib3 response). A longer body's
    connection is closed, not handed back to the pool with the rest unread."""
    data = bytearray()
    while len(data) <= cap and (chunk := raw.read(cap + 1 - len(data))):
        data += chunk
    if len(data) > cap:
        raw.close()
        del data[cap:]
    return bytes(data)
