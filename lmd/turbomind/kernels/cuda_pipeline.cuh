// Shared-memory pipeline primitives of lmd's CUDA kernels: cp.async copies and their commit groups, shared loads and
// stores by address, mbarriers, the async-proxy fence, packed half multiplies. Prepended to a kernel's source after
// w4a16_mma_fragment.cuh.
__device__ __forceinline__ u32 smem_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronously; with valid false the 16 bytes are zero-filled and nothing is read
__device__ __forceinline__ void copy16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void wait_stages() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

__device__ __forceinline__ U4 lds128(u32 address) {
    U4 r;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(address));
    return r;
}

__device__ __forceinline__ void lds64(u32 address, u32& a, u32& b) {
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "r"(address));
}

// a * b on both halves (b a power of two here: exact)
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
#if BF16
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
    return r;
}

__device__ __forceinline__ void sts128(u32 address, const U4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ u32 lds32(u32 address) {
    u32 r;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(address));
    return r;
}

__device__ __forceinline__ u16 lds16(u32 address) {
    u16 r;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(r) : "r"(address));
    return r;
}

// mbarriers in shared memory: a phase completes when `count` arrivals (set at init) are in; a wait passes once the
// phase of the given parity is over (try_wait.parity)
__device__ __forceinline__ void barrier_init(u32 address, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(address), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_arrive(u32 address) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(address) : "memory");
}

__device__ __forceinline__ void barrier_wait(u32 address, int parity) {
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}" ::"r"(address), "r"(parity) : "memory");
}

// this thread's generic-proxy writes of shared memory (st.shared, cp.async) ordered before async-proxy reads (wgmma)
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
