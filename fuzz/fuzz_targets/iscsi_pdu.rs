//! PDU framing: BHS, AHS, header/data digests, padding and the data segment limit, over an
//! arbitrary byte stream. See `zebu_testkit::fuzz::iscsi::pdu_stream`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    zebu_testkit::fuzz::iscsi::pdu_stream(data);
});
