//! SQLite storage of keel: schema v6, forward-only migrations, domain APIs. The only crate that knows SQL.
