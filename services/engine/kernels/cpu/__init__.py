"""Native CPU kernels: cpu_native.cpp (C++, AVX-512 where the compiler targets it) and the
ctypes binding in cpu_native.py that builds it once per machine and calls it."""
