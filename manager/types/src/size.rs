//! Byte sizes as people type them: `10G`, `1Ti`, `512M`, `4096`.
//!
//! Both decimal-looking suffixes (`K`, `M`, `G`, `T`, `P`) and binary ones
//! (`Ki`, `Mi`, `Gi`, `Ti`, `Pi`) mean powers of 1024: this is block storage,
//! where "a 10G volume" always means 10 GiB, and Kubernetes quantities written
//! as `10Gi` must give the same number. A trailing `B` (`10GB`, `10GiB`) is
//! accepted and ignored. Parsing is strict: no fractions, no signs, no
//! whitespace inside, and overflow is an error rather than a wrap.
//!
//! [`ByteSize`] is the one type every resource uses for a size; it serialises
//! as a plain integer of bytes so the stored JSON and the CRD schema are exact.
//!
//! The parsing itself is `zebu-size`'s, the one size parser of every Zebu program (the
//! replica and engine command lines and the benchmarks use it too).

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A number of bytes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

impl JsonSchema for ByteSize {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ByteSize".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "integer", "format": "uint64", "minimum": 0 })
    }
}

pub use zebu_size::SizeError;

impl FromStr for ByteSize {
    type Err = SizeError;

    fn from_str(input: &str) -> Result<Self, SizeError> {
        zebu_size::parse(input).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the size exactly (`10 GiB`,
    /// `1536 MiB`), so printing never rounds a size someone has to trust.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        if self.0 == 0 {
            return write!(f, "0 B");
        }
        let mut power = 0;
        let mut value = self.0;
        while power < 5 && value.is_multiple_of(1024) {
            value /= 1024;
            power += 1;
        }
        write!(f, "{value} {}", NAMES[power])
    }
}

impl ByteSize {
    pub const KIB: u64 = 1024;
    pub const MIB: u64 = 1024 * 1024;
    pub const GIB: u64 = 1024 * 1024 * 1024;

    pub fn bytes(self) -> u64 {
        self.0
    }

    /// A rounded, human form for capacities that are not exact (`14.9 GiB`).
    pub fn approx(self) -> String {
        const NAMES: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut value = self.0 as f64;
        let mut power = 0;
        while power < 5 && value >= 1024.0 {
            value /= 1024.0;
            power += 1;
        }
        if power == 0 || value.fract() == 0.0 {
            format!("{value:.0} {}", NAMES[power])
        } else {
            format!("{value:.1} {}", NAMES[power])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<u64, SizeError> {
        s.parse::<ByteSize>().map(|b| b.0)
    }

    #[test]
    fn units_are_powers_of_1024() {
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse("512M"), Ok(512 << 20));
        assert_eq!(parse("512Mi"), Ok(512 << 20));
        assert_eq!(parse("10G"), Ok(10 << 30));
        assert_eq!(parse("10g"), Ok(10 << 30));
        assert_eq!(parse("10GiB"), Ok(10 << 30));
        assert_eq!(parse("10GB"), Ok(10 << 30));
        assert_eq!(parse("1Ti"), Ok(1 << 40));
        assert_eq!(parse("2P"), Ok(2 << 50));
        assert_eq!(parse("7B"), Ok(7));
        assert_eq!(parse("1K"), Ok(1024));
    }

    #[test]
    fn malformed_sizes_are_refused_with_the_input_in_the_message() {
        assert_eq!(parse(""), Err(SizeError::Empty));
        for bad in ["G", "-1G", "+1G", "1.5G", "1,5G", " 1G", "1 G", "abc"] {
            let err = parse(bad).expect_err(bad);
            assert!(
                err.to_string().contains(&format!("{bad:?}")),
                "{bad}: {err}"
            );
        }
        assert!(matches!(parse("10X"), Err(SizeError::UnknownUnit { .. })));
        assert!(matches!(parse("10i"), Err(SizeError::UnknownUnit { .. })));
        assert!(matches!(
            parse("10GiBB"),
            Err(SizeError::UnknownUnit { .. })
        ));
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        assert!(matches!(parse("16384P"), Err(SizeError::Overflow { .. })));
        let e = parse("99999999999T").expect_err("too large");
        assert!(
            e.to_string()
                .starts_with("size \"99999999999T\" is too large"),
            "{e}"
        );
        assert!(matches!(
            parse("99999999999999999999999"),
            Err(SizeError::Overflow { .. })
        ));
        assert_eq!(parse("16383P"), Ok(16383 << 50));
    }

    #[test]
    fn display_is_exact() {
        assert_eq!(ByteSize(10 << 30).to_string(), "10 GiB");
        assert_eq!(ByteSize(1536 << 20).to_string(), "1536 MiB");
        assert_eq!(ByteSize(4097).to_string(), "4097 B");
        assert_eq!(
            ByteSize(15 * ByteSize::GIB + ByteSize::GIB / 2).approx(),
            "15.5 GiB"
        );
    }
}
