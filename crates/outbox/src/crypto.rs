//! The one TLS crypto provider of the stores and the sinks, on the bottom floor: it imports
//! nothing of the crate.

/// rustls' *ring* provider, the one crypto provider of the stores' and the sinks' TLS (see
/// `sink::tls`). rustls 0.23.48 deprecates `crypto::ring::default_provider` ("no support
/// for post-quantum algorithms") and has no *ring* provider that is not deprecated: its
/// other one, aws-lc-rs, is a C and CMake build this crate does not take on. The library's
/// one allowance is here, so that neither the locked rustls nor a newer 0.23 warns.
#[allow(deprecated)]
pub(crate) fn ring_provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}
