//! `zebu-size`: byte sizes as people type them, `10G`, `1Ti`, `512M`, `4096`, parsed the same
//! way by every Zebu program (the replica and engine command lines, the benchmarks, the
//! manager's API and CLI through `zebu_types::size::ByteSize`).
//!
//! Both decimal-looking suffixes (`K`, `M`, `G`, `T`, `P`, any case) and binary ones (`Ki`,
//! `Mi`, `Gi`, `Ti`, `Pi`) mean powers of 1024: this is block storage, where "a 10G volume"
//! always means 10 GiB, and Kubernetes quantities written as `10Gi` must give the same
//! number. A trailing `B` (`10GB`, `10GiB`) is accepted and ignored. Parsing is strict: no
//! fractions, no signs, no whitespace, and overflow is an error rather than a wrap.
//!
//! ```
//! assert_eq!(zebu_size::parse("10G"), Ok(10 << 30));
//! assert_eq!(zebu_size::parse("512Mi"), Ok(512 << 20));
//! assert!(zebu_size::parse("1.5G").is_err());
//! assert!(zebu_size::parse_nonzero("0").is_err());
//! ```

/// Why a size string was refused; the message names the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("empty size")]
    Empty,
    #[error(
        "invalid size {input:?}: expected a whole number with an optional unit (K, M, G, T, P, Ki, Mi, Gi, Ti, Pi), like 10G or 512Mi"
    )]
    Malformed { input: String },
    #[error(
        "invalid size {input:?}: unknown unit {unit:?} (use K, M, G, T, P or Ki, Mi, Gi, Ti, Pi)"
    )]
    UnknownUnit { input: String, unit: String },
    #[error("size {input:?} is too large: a size must be below 16 EiB (2^64 bytes, 16384P)")]
    Overflow { input: String },
    #[error("invalid size {input:?}: must be more than zero")]
    Zero { input: String },
}

const UNITS: [(&str, u32); 6] = [("", 0), ("K", 1), ("M", 2), ("G", 3), ("T", 4), ("P", 5)];

/// Parse a size in bytes; see the crate docs.
pub fn parse(input: &str) -> Result<u64, SizeError> {
    if input.is_empty() {
        return Err(SizeError::Empty);
    }
    let malformed = || SizeError::Malformed {
        input: input.to_string(),
    };
    let digits_end = input
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(input.len());
    if digits_end == 0 {
        return Err(malformed());
    }
    let (digits, unit) = input.split_at(digits_end);
    let number: u64 = digits.parse().map_err(|_| SizeError::Overflow {
        input: input.to_string(),
    })?;
    if unit.starts_with('.') || unit.starts_with(',') {
        return Err(malformed());
    }
    let u = unit
        .strip_suffix('B')
        .or_else(|| unit.strip_suffix('b'))
        .unwrap_or(unit);
    let u = u
        .strip_suffix('i')
        .or_else(|| u.strip_suffix('I'))
        .unwrap_or(u);
    let upper = u.to_ascii_uppercase();
    let power = UNITS
        .iter()
        .find(|(name, _)| *name == upper)
        .map(|(_, p)| *p)
        .ok_or_else(|| {
            if unit
                .chars()
                .any(|c| c.is_whitespace() || c == '-' || c == '+')
            {
                malformed()
            } else {
                SizeError::UnknownUnit {
                    input: input.to_string(),
                    unit: unit.to_string(),
                }
            }
        })?;
    // "10i" has no unit letter before the "i": refuse it instead of reading bytes.
    if power == 0 && !unit.is_empty() && !unit.eq_ignore_ascii_case("b") {
        return Err(SizeError::UnknownUnit {
            input: input.to_string(),
            unit: unit.to_string(),
        });
    }
    1024u64
        .checked_pow(power)
        .and_then(|m| number.checked_mul(m))
        .ok_or_else(|| SizeError::Overflow {
            input: input.to_string(),
        })
}

/// [`parse`], refusing zero (a volume or a block size cannot be empty).
pub fn parse_nonzero(input: &str) -> Result<u64, SizeError> {
    match parse(input)? {
        0 => Err(SizeError::Zero {
            input: input.to_string(),
        }),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_powers_of_1024_in_any_case() {
        assert_eq!(parse("0"), Ok(0));
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse("512M"), Ok(512 << 20));
        assert_eq!(parse("512Mi"), Ok(512 << 20));
        assert_eq!(parse("10G"), Ok(10 << 30));
        assert_eq!(parse("10g"), Ok(10 << 30));
        assert_eq!(parse("10GiB"), Ok(10 << 30));
        assert_eq!(parse("2gib"), Ok(2 << 30));
        assert_eq!(parse("10GB"), Ok(10 << 30));
        assert_eq!(parse("1Ti"), Ok(1 << 40));
        assert_eq!(parse("1t"), Ok(1 << 40));
        assert_eq!(parse("2P"), Ok(2 << 50));
        assert_eq!(parse("7B"), Ok(7));
        assert_eq!(parse("1K"), Ok(1024));
    }

    #[test]
    fn malformed_sizes_are_refused_with_the_input_in_the_message() {
        assert_eq!(parse(""), Err(SizeError::Empty));
        for bad in [
            "G", "-1G", "+1G", "1.5G", "1,5G", " 1G", "1 G", "1G ", "abc",
        ] {
            let err = parse(bad).expect_err(bad);
            assert!(
                err.to_string().contains(&format!("{bad:?}")),
                "{bad}: {err}"
            );
        }
        assert!(matches!(parse("10X"), Err(SizeError::UnknownUnit { .. })));
        assert!(matches!(parse("10Q"), Err(SizeError::UnknownUnit { .. })));
        assert!(matches!(parse("10i"), Err(SizeError::UnknownUnit { .. })));
        assert!(matches!(
            parse("10GiBB"),
            Err(SizeError::UnknownUnit { .. })
        ));
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        assert!(matches!(parse("16384P"), Err(SizeError::Overflow { .. })));
        assert!(matches!(
            parse("99999999999T"),
            Err(SizeError::Overflow { .. })
        ));
        assert!(matches!(
            parse("99999999999999999999999"),
            Err(SizeError::Overflow { .. })
        ));
        assert_eq!(parse("16383P"), Ok(16383 << 50));
    }

    #[test]
    fn zero_is_refused_only_where_asked() {
        assert_eq!(parse("0G"), Ok(0));
        let e = parse_nonzero("0").expect_err("zero");
        assert_eq!(e.to_string(), "invalid size \"0\": must be more than zero");
        assert_eq!(parse_nonzero("4K"), Ok(4096));
    }
}
