//! Login and text key negotiation: the `key=value` parser and per-key negotiation on the raw
//! input, then the login state machine over Login Request PDUs built from the same input,
//! then the full feature phase's Text exchange over Text Requests built from it.
//! See `zebu_testkit::fuzz::iscsi::{text_keys, login_exchange, text_exchange}`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    zebu_testkit::fuzz::iscsi::text_keys(data);
    zebu_testkit::fuzz::iscsi::login_exchange(data);
    zebu_testkit::fuzz::iscsi::text_exchange(data);
});
