"""The CUDA runtime (cuda-python), imported only when something asks for it.

A missing package is reported as an `Unavailable` error that says what to install; a failing call as an
`Internal` error naming the call (`check`).
"""

from __future__ import annotations

from .errors import Internal, Unavailable

NO_DEVICE = "CUDA shared memory is not supported by this server: it needs a CUDA device"


def cudart():
    """The CUDA runtime bindings: `cuda.bindings.runtime` (cuda-python >= 12.6) or the older `cuda.cudart`."""
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart as runtime

        return runtime
    except ImportError:
        raise Unavailable(
            "CUDA support needs the 'cuda-python' package: pip install 'naiad[tensorrt]' (or cuda-python>=12)"
        ) from None


def check(result, what: str):
    """Unpack a cuda-python call's `(error, *values)`; raise Internal naming the call on failure."""
    rt = cudart()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != rt.cudaError_t.cudaSuccess:
        try:
            _, text = rt.cudaGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:
            text = str(err)
        raise Internal(f"{what} failed: {text} ({getattr(err, 'name', err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def cuda_unavailable_reason() -> str | None:
    """None when CUDA really works here (cuda-python imports and sees a device), else why not."""
    try:
        rt = cudart()
    except Unavailable as exc:
        return exc.message
    try:
        n = check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
    except Exception as exc:
        return f"CUDA shared memory is not supported by this server: the CUDA runtime reports {exc}"
    if not n:
        return NO_DEVICE
    return None


def set_device(device_id: int) -> None:
    rt = cudart()
    check(rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")


def allocation_size(pointer: int) -> int | None:
    """Size of the device allocation `pointer` starts in (driver API), or None when that cannot be asked."""
    try:
        try:
            from cuda.bindings import driver
        except ImportError:
            from cuda import cuda as driver
        err, base, size = driver.cuMemGetAddressRange(pointer)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        return int(size) - (pointer - int(base))
    except Exception:
        return None
