"""What S3's answers mean: the HTTP status and error code of a botocore ClientError, whether
botocore had retried the request, a condition that did not hold, and which faults are worth
another try (`is_transient`, also the rule for s3:// through s3fs: fsspec.py). Shared by the
S3 backend (s3.py) and its transfers (s3_transfer.py); botocore is imported only inside
is_transient, so importing this stays instant.
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

