// Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11; the constants of Random123). Four
// 32-bit words that are a pure function of a 128-bit counter and a 64-bit key, so that any thread can
// draw the numbers of any position without a state. llama/twins/init.py holds its numpy twin.
#pragma once

__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            key.x += 0x9E3779B9u;
            key.y += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, counter.x), lo0 = 0xD2511F53u * counter.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, counter.z), lo1 = 0xCD9E8D57u * counter.z;
        counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    }
    return counter;
}
