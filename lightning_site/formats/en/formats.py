# Operators compare times to the second (heartbeats, deadlines): the admin shows them in full
# instead of English's "Dec. 1, 2026, 3 a.m.".
DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATETIME_FORMAT = "Y-m-d H:i:s"
