//! PDU framing: BHS, AHS, header/data digests, padding and the data segment limit, over an
//! arbitrary byte stream. See `zebu_engine::iscsi::fuzzing::pdu_stream`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    zebu_engine::iscsi::fuzzing::pdu_stream(data);
});
