// A raw SQLite connection to a database file, as another process would have one: for tests that
// look at what the coordinator stored, hold its locks, or check the file's integrity.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace infersweep {

class RawDb {
 public:
  explicit RawDb(const std::string& path) {
    EXPECT_EQ(sqlite3_open(path.c_str(), &db_), SQLITE_OK);
    sqlite3_busy_timeout(db_, 2000);
  }
  ~RawDb() { sqlite3_close(db_); }
  int Exec(const std::string& sql) {
    return sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, nullptr);
  }
  // The first column of the first row, as text ("" if none).
  std::string Query(const std::string& sql) {
    sqlite3_stmt* stmt = nullptr;
    std::string out;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
      ADD_FAILURE() << sql << ": " << sqlite3_errmsg(db_);
      return out;
    }
    if (sqlite3_step(stmt) == SQLITE_ROW && sqlite3_column_text(stmt, 0) != nullptr)
      out = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
    sqlite3_finalize(stmt);
    return out;
  }
  // Every row, every column as text (NULL as "").
  std::vector<std::vector<std::string>> Rows(const std::string& sql) {
    sqlite3_stmt* stmt = nullptr;
    std::vector<std::vector<std::string>> rows;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
      ADD_FAILURE() << sql << ": " << sqlite3_errmsg(db_);
      return rows;
    }
    while (sqlite3_step(stmt) == SQLITE_ROW) {
      std::vector<std::string> row;
      for (int c = 0; c < sqlite3_column_count(stmt); ++c) {
        const unsigned char* text = sqlite3_column_text(stmt, c);
        row.push_back(text != nullptr ? reinterpret_cast<const char*>(text) : "");
      }
      rows.push_back(std::move(row));
    }
    sqlite3_finalize(stmt);
    return rows;
  }
  // Every row of EXPLAIN QUERY PLAN, joined.
  std::string Plan(const std::string& sql) {
    sqlite3_stmt* stmt = nullptr;
    std::string out;
    const std::string explain = "EXPLAIN QUERY PLAN " + sql;
    if (sqlite3_prepare_v2(db_, explain.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
      ADD_FAILURE() << explain << ": " << sqlite3_errmsg(db_);
      return out;
    }
    while (sqlite3_step(stmt) == SQLITE_ROW)
      out += std::string(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 3))) + "\n";
    sqlite3_finalize(stmt);
    return out;
  }
  int64_t Count(const std::string& table) {
    return std::stoll(Query("SELECT COUNT(*) FROM " + table));
  }

 private:
  sqlite3* db_ = nullptr;
};

}  // namespace infersweep
