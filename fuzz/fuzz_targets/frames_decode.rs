//! The data-frames decoders (hello with its extensions and volume claim, requests,
//! responses) on arbitrary bytes. See `zebu_replica::server::fuzzing::decoders`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    zebu_replica::server::fuzzing::decoders(data);
});
