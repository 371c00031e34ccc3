//! One access log line per connection.
