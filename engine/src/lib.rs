//! The Zebu volume engine.
//!
//! (Overview to be written with the implementation.)

pub mod blockdev;
pub mod iscsi;
pub mod nbd;
